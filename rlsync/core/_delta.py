"""Delta versions: a writer sends only the values that changed since the version a reader's slot
holds, as positions and values, and the reader writes them into that slot.

RL updates are tiny (learning rates around 1e-6): from one step to the next a few percent of bf16
values change, scattered evenly, so nearly every 4 KiB block holds a change and sending changed
blocks saves little; positions + values do (6 bytes per changed bf16 value with 4-byte positions).

Everything here is torch ops on whatever device the bytes live on: a GPU trainer finds and encodes
its delta on the GPU, a reader landing in device memory applies it there, and CPU tests run the same
lines. (On CPU torch matched the numpy version this replaced: ``rlsync bench --wire delta``.)

The encoding: ``int64 S``, then ``S`` segment headers ``int64 [base, itemsize, count]``, then each
segment's body: ``count`` positions (uint32: elements of ``itemsize`` bytes after element ``base`` of
the reader's region) and the ``count`` values' bytes, each padded to 8 bytes. The headers come first so
that a reader on a GPU reads them in one small copy. Equal bits, not equal floats: a value is "changed"
when its bytes differ, so the reader ends bit-exact (NaN payloads and -0.0 included).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import torch

#: share of a writer's bytes to a reader that the reader's inbox holds for its deltas; a larger
#: delta is sent in full (with 4-byte positions: up to ~8 % of bf16 values changed)
INBOX_SHARE: Final = 0.25
_SPAN: Final = 2**32
#: integer dtypes compared and copied as bits (signed: equal bits are equal integers either way)
_WORD: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def typed(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """A 1-D ``uint8`` tensor seen as integers of ``itemsize`` bytes (compared and copied as bits)."""
    return raw[: raw.numel() // itemsize * itemsize].view(_WORD[itemsize])


def _pad8(nbytes: int) -> int:
    return -nbytes % 8


class ChangeLog:
    """Writer side: which elements of each source buffer changed, version by version (the newest ``depth``).

    Keeps one copy of the last recorded bytes (the writer rank's share of the model) to compare against,
    on the sources' device: a GPU trainer pays its share of the model in device memory for delta sync.
    """

    def __init__(self, itemsizes: Mapping[str, int], depth: int = 4) -> None:
        self._itemsizes = dict(itemsizes)
        self._depth = depth
        self._shadow: dict[str, torch.Tensor] = {}
        self._history: list[tuple[int, dict[str, torch.Tensor | None]]] = []

    def record(self, version: int, sources: Mapping[str, torch.Tensor]) -> None:
        """Compare ``sources`` (``uint8`` tensors) with the last recorded bytes and remember what changed."""
        changes: dict[str, torch.Tensor | None] = {}
        for name, raw in sources.items():
            now = typed(raw, self._itemsizes[name])
            shadow = self._shadow.get(name)
            if shadow is None or shadow.numel() != now.numel() or shadow.device != now.device:
                self._shadow[name] = now.clone()
                changes[name] = None  # never seen: all of it
                continue
            changed = torch.nonzero(now != shadow).flatten()
            shadow[changed] = now[changed]
            changes[name] = changed
        self._history = [*self._history, (version, changes)][-self._depth :]

    def since(self, base: int, name: str) -> torch.Tensor | None:
        """Elements of ``name`` that changed after version ``base`` up to the newest recorded (sorted int64);
        None: unknown."""
        versions = [v for v, _ in self._history]
        if base not in versions:
            return None
        found = [changes.get(name) for _, changes in self._history[versions.index(base) + 1 :]]
        parts = [p for p in found if p is not None]
        if len(parts) < len(found):
            return None
        if not parts:
            shadow = self._shadow.get(name)
            return torch.empty(0, dtype=torch.int64, device=None if shadow is None else shadow.device)
        if len(parts) == 1:
            return parts[0]
        merged: torch.Tensor = torch.unique(torch.cat(parts))  # sorted
        return merged


def _elements(idx: torch.Tensor, runs: Sequence[tuple[int, int, int]], itemsize: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The changed source elements ``idx`` that ``runs`` ``(src_off, region_off, nbytes)`` send, and the region
    elements they land on."""
    if len(runs) == 1:  # the usual whole-tensor buffer: one run, positions shift by a constant
        (s0, d0, n0), = runs
        bounds = torch.tensor([s0 // itemsize, (s0 + n0) // itemsize], dtype=idx.dtype, device=idx.device)
        lo, hi = torch.searchsorted(idx, bounds).tolist()
        idx = idx[lo:hi]
        return idx, idx + (d0 - s0) // itemsize
    table = torch.tensor(sorted(runs), dtype=torch.int64, device=idx.device).T.contiguous()  # sorted by source offset
    src, dst, length = table[0], table[1], table[2]
    at = idx * itemsize
    k = torch.searchsorted(src, at, right=True) - 1
    kc = k.clamp(min=0)
    inside = (k >= 0) & (at < src[kc] + length[kc])
    at, kc, idx = at[inside], kc[inside], idx[inside]
    return idx, (dst[kc] + at - src[kc]) // itemsize


def encode(
    groups: Sequence[tuple[str, Sequence[tuple[int, int, int]]]],
    changed: Mapping[str, torch.Tensor | None],
    sources: Mapping[str, torch.Tensor],
    itemsizes: Mapping[str, int],
    capacity: int,
) -> torch.Tensor | None:
    """The delta of one writer's part for one reader, a ``uint8`` tensor on the sources' device: ``groups`` are
    its ``(source buffer, [(src_off, region_off, nbytes), ...])`` runs; ``changed`` the changed elements per
    source buffer. None when a buffer's changes are unknown or the encoding would exceed ``capacity`` bytes
    (send in full then)."""
    headers: list[int] = []
    bodies: list[torch.Tensor] = []
    size = 8
    device = None
    for name, runs in groups:
        idx = changed.get(name)
        if idx is None:
            return None
        if not idx.numel():
            continue
        itemsize = itemsizes[name]
        device = idx.device
        idx, element = _elements(idx, runs, itemsize)
        if not idx.numel():
            continue
        values = typed(sources[name], itemsize)[idx]
        low, high = (int(x) for x in torch.stack([element.min(), element.max()]).tolist())
        if len(runs) > 1 and high - low >= _SPAN:  # several segments: sort to cut them
            element, order = torch.sort(element, stable=True)
            values = values[order]
        start, count_all = 0, element.numel()
        while start < count_all:  # segments whose positions fit in uint32
            low = int(element[start:].min()) if start else low
            stop = count_all if high - low < _SPAN else int(torch.searchsorted(element, low + _SPAN))
            count = stop - start
            size += 24 + count * 4 + _pad8(count * 4) + count * itemsize + _pad8(count * itemsize)
            if size > capacity:
                return None
            positions = (element[start:stop] - low).view(torch.int32).reshape(-1, 2)[:, 0]  # the low words (little endian)
            bodies += [positions.clone(memory_format=torch.contiguous_format).view(torch.uint8), _zeros(_pad8(count * 4), device),
                       values[start:stop].clone(memory_format=torch.contiguous_format).view(torch.uint8),
                       _zeros(_pad8(count * itemsize), device)]
            headers += [low, itemsize, count]
            start = stop
    if not headers:
        return torch.empty(0, dtype=torch.uint8, device=device)
    head = torch.tensor([len(headers) // 3, *headers], dtype=torch.int64).view(torch.uint8).to(device)
    return torch.cat([head, *bodies])


def _zeros(nbytes: int, device: torch.device | None) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def apply(payload: torch.Tensor, region: torch.Tensor) -> int:
    """Write an ``encode``-d delta into ``region`` (``uint8``, any device); the number of values written.
    Checks every segment against the region before writing any (a bad delta raises ``ValueError`` and
    changes nothing)."""
    if not payload.numel():
        return 0
    if payload.numel() < 8:
        raise ValueError(f"a {payload.numel()}-byte delta has no segment count")
    segments = int(payload[:8].view(torch.int64))
    if segments < 0 or 8 + 24 * segments > payload.numel():
        raise ValueError(f"a {payload.numel()}-byte delta cannot hold {segments} segment headers")
    headers = payload[8 : 8 + 24 * segments].view(torch.int64).reshape(-1, 3).tolist()
    at = 8 + 24 * segments
    parts: list[tuple[torch.Tensor, torch.Tensor, int]] = []
    for base, itemsize, count in headers:
        if itemsize not in _WORD or count < 0 or base < 0:
            raise ValueError(f"delta segment header [{base}, {itemsize}, {count}] is not a segment")
        end = at + count * 4 + _pad8(count * 4) + count * itemsize + _pad8(count * itemsize)
        if end > payload.numel():
            raise ValueError(f"delta segment at element {base} ({count} values) runs past the {payload.numel()}-byte delta")
        positions = payload[at : at + 4 * count].view(torch.uint32).to(torch.int64).add_(base)
        at += count * 4 + _pad8(count * 4)
        parts.append((positions, payload[at : at + itemsize * count].view(_WORD[itemsize]), itemsize))
        at = end
    if parts:  # one look at the positions' extremes for all segments (one device sync on a GPU)
        reach = torch.stack([p.max() if p.numel() else p.new_zeros(()) for p, _, _ in parts]).tolist()
        for (_, values, itemsize), last in zip(parts, reach):
            if values.numel() and (last + 1) * itemsize > region.numel():
                raise ValueError(f"a delta segment ({values.numel()} values) reaches past the {region.numel()}-byte region")
    for positions, values, itemsize in parts:
        typed(region, itemsize).index_copy_(0, positions, values)  # positions are unique: no write races on a GPU
    return sum(v.numel() for _, v, _ in parts)
