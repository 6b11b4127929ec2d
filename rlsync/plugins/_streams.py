"""The streams a device link's copies must wait for, noted cheaply: a link's ``write`` runs once per tensor per
version, and ``torch.cuda.current_stream`` builds a new ``Stream`` object (hashing one builds a ``torch.device``)
each time: several microseconds a tensor, tens of milliseconds for a model of 1600 tensors, against 4 ms for
copying all 4 GiB of them on an H100. The raw stream pointer is one call; a ``Stream`` is built once per stream.
CUDA-only: tested under the ``gpu`` marker (tests/gpu) and by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# torch's own cheap lookup (what torch.compile's generated code calls); absent from CPU builds, where no write
# gets here
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CurrentStreams:
    """The streams current in this thread on the devices written from, since the last ``clear``."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], Any] = {}  # (device index, raw stream) -> its torch.cuda.Stream

    def note(self, device_index: int) -> None:
        """Note the stream current on ``device_index`` now: the copies wait for what was queued on it so far."""
        if _raw_stream is None:
            stream = torch.cuda.current_stream(device_index)
            self._seen.setdefault((device_index, stream.cuda_stream), stream)
            return
        key = (device_index, _raw_stream(device_index))
        if key not in self._seen:
            self._seen[key] = torch.cuda.current_stream(device_index)

    def streams(self) -> Iterable[Any]:
        return list(self._seen.values())

    def clear(self) -> None:
        self._seen = {}
