"""Per-buffer checksums a writer sends with a version and a reader compares with the bytes that landed.

Two algorithms, chosen by where the reader's landing memory is (the reader names it in its Welcome;
the writer computes the same one over its sources):

* ``crc32`` for host memory: zlib's CRC-32, 7 GB/s on one CPU core (measured here; a torch version
  ran at 0.14 GB/s on the same machine).
* ``sum64`` for device memory: a position-weighted sum of the bytes' words, mod 2**64, as torch ops on
  whatever device the bytes are on (memory-bound on a GPU; no copy to the host). Any change to one word
  changes it (every weight is odd); a swap of two words goes unseen only with odds of about 2**-60. It
  guards against bytes landing wrong (a torn or misdirected write), not against an attacker.

Both continue over a buffer's runs in plan order: the writer reads ``source[s:s+n]``, the reader
``region[d:d+n]``, the same lengths in the same order. Each run's words are its 4-byte words when its
length allows (else 2-byte, else bytes), fixed by the length alone, so both sides agree whatever
their alignment.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import torch

from rlsync.core.sync._regions import as_tensor

ALGORITHMS: Final = ("crc32", "sum64")
_MASK: Final = 2**64 - 1
_STEP: Final = 1 << 22  # words per pass: bounds the int64 temporaries (32 MiB each)
_ODD: Final = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive positions over all bits
_WORDS: Final = ((4, torch.int32), (2, torch.int16), (1, torch.uint8))
_weights: dict[torch.device, torch.Tensor] = {}


def for_memory(memory: str) -> str:
    """The algorithm a reader whose regions are in ``memory`` (``"host"`` or ``"device"``) checks with."""
    return "sum64" if memory == "device" else "crc32"


def _position_weights(device: torch.device) -> torch.Tensor:
    """``_STEP`` odd int64 weights, one per word position of a pass (made once per device)."""
    if device not in _weights:
        odd = _ODD - 2**64  # as a signed int64; products wrap mod 2**64
        _weights[device] = (torch.arange(1, _STEP + 1, dtype=torch.int64, device=device) * odd) | 1
    return _weights[device]


def _sum64(chunk: torch.Tensor, index: int) -> int:
    """The weighted sum of one run's words; ``index`` (the run's place in the buffer's runs) makes order count."""
    size, dtype = next((s, d) for s, d in _WORDS if chunk.numel() % s == 0)
    if chunk.storage_offset() % size:
        chunk = chunk.clone()  # a view at an odd address cannot be read as wider words
    words = chunk.view(dtype)
    weights = _position_weights(words.device)
    total = torch.zeros((), dtype=torch.int64, device=words.device)
    for k, at in enumerate(range(0, words.numel(), _STEP)):
        part = words[at : at + _STEP].to(torch.int64)
        # each pass and each run gets its own odd multiplier: a word moved to another pass or run changes the sum
        total += (part * weights[: part.numel()]).sum() * (((index << 20) + k) * 2 + 1)
    return int(total) & _MASK


class Checksums:
    """Per-buffer checksums over runs added in plan order (one instance per version and peer)."""

    def __init__(self, algorithm: str) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}: one of {ALGORITHMS}")
        self.algorithm = algorithm
        self.values: dict[str, int] = {}
        self._runs: dict[str, int] = {}

    def add(self, buffer: str, chunks: Iterable[Any]) -> None:
        """Continue ``buffer``'s checksum over ``chunks`` (``uint8`` numpy arrays or tensors, its next runs)."""
        value = self.values.get(buffer, 0)
        if self.algorithm == "crc32":
            for chunk in chunks:
                if isinstance(chunk, torch.Tensor):
                    chunk = chunk.cpu().numpy()  # device bytes checked for a host reader: copied (a rare pairing)
                value = zlib.crc32(chunk.data, value)
        else:
            for chunk in chunks:
                index = self._runs.get(buffer, 0)
                self._runs[buffer] = index + 1
                value = (value + _sum64(as_tensor(chunk), index)) & _MASK
        self.values[buffer] = value


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bytes, each checksummed where it lives (``sum64``: a parameter on a GPU and
    its landed copy on the host are compared without moving either)."""
    sums = [Checksums("sum64") for _ in (a, b)]
    for checksum, tensor in zip(sums, (a, b)):
        checksum.add("t", [tensor.contiguous().reshape(-1).view(torch.uint8)])
    return sums[0].values == sums[1].values


def digest(checksums_by_writer: Mapping[int, Mapping[str, int]]) -> str:
    """A version's fingerprint on one reader: its writers' per-buffer checksums (those it checked the landed bytes
    against), hashed in a fixed order. 16 hex digits."""
    text = ";".join(f"{w}:{b}:{c}" for w in sorted(checksums_by_writer) for b, c in sorted(checksums_by_writer[w].items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def version_label(version: int, digests: Sequence[str | None]) -> str:
    """The label an engine reports for ``version`` (vLLM's ``weight_version``): ``"V"``, or ``"V+DIGEST"`` when its
    readers (in rank order) have digests: the version bound to the bytes it serves."""
    if not digests or any(d is None for d in digests):
        return str(version)
    return f"{version}+{hashlib.sha256('|'.join(str(d) for d in digests).encode()).hexdigest()[:16]}"
