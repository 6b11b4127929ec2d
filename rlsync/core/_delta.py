"""Delta versions: a writer sends only the values that changed since the version a reader's slot
holds, as positions and values, and the reader writes them into that slot.

RL updates are tiny (learning rates around 1e-6): from one step to the next a few percent of bf16
values change, scattered evenly, so nearly every 4 KiB block holds a change and sending changed
blocks saves little; positions + values do (6 bytes per changed bf16 value with 4-byte positions).

The encoding is a list of segments, each ``int64 [base, itemsize, count]``, then ``count`` uint32
positions (elements of ``itemsize`` bytes after element ``base`` of the reader's region), then the
``count`` values' bytes, padded to 8 bytes. Equal bits, not equal floats: a value is "changed" when
its bytes differ, so the reader ends bit-exact (NaN payloads and -0.0 included).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

import numpy as np

#: share of a writer's bytes to a reader that the reader's inbox holds for its deltas; a larger
#: delta is sent in full (with 4-byte positions: up to ~8 % of bf16 values changed)
INBOX_SHARE: Final = 0.25
_HEADER: Final = 3 * 8
_SPAN: Final = 2**32
_UINT: Final = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def typed(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """A 1-D ``uint8`` array seen as unsigned integers of ``itemsize`` bytes (compared and copied as bits)."""
    return raw[: len(raw) // itemsize * itemsize].view(_UINT[itemsize])


class ChangeLog:
    """Writer side: which elements of each source buffer changed, version by version (the newest ``depth``).

    Keeps one copy of the last recorded bytes (the writer rank's share of the model) to compare against.
    """

    def __init__(self, itemsizes: Mapping[str, int], depth: int = 4) -> None:
        self._itemsizes = dict(itemsizes)
        self._depth = depth
        self._shadow: dict[str, np.ndarray] = {}
        self._history: list[tuple[int, dict[str, np.ndarray | None]]] = []

    def record(self, version: int, sources: Mapping[str, np.ndarray]) -> None:
        """Compare ``sources`` (``uint8`` views) with the last recorded bytes and remember what changed."""
        changes: dict[str, np.ndarray | None] = {}
        for name, raw in sources.items():
            now = typed(raw, self._itemsizes[name])
            shadow = self._shadow.get(name)
            if shadow is None or len(shadow) != len(now):
                self._shadow[name] = now.copy()
                changes[name] = None  # never seen: all of it
                continue
            changed = np.flatnonzero(now != shadow)
            shadow[changed] = now[changed]
            changes[name] = changed
        self._history = [*self._history, (version, changes)][-self._depth :]

    def since(self, base: int, name: str) -> np.ndarray | None:
        """Elements of ``name`` that changed after version ``base`` up to the newest recorded; None: unknown."""
        versions = [v for v, _ in self._history]
        if base not in versions:
            return None
        found = [changes.get(name) for _, changes in self._history[versions.index(base) + 1 :]]
        parts = [p for p in found if p is not None]
        if len(parts) < len(found):
            return None
        if not parts:
            return np.empty(0, np.int64)
        if len(parts) == 1:
            return parts[0]
        merged = np.sort(np.concatenate(parts), kind="stable")  # sorted runs: timsort merges them in linear time
        keep = np.empty(len(merged), bool)
        keep[:1] = True
        np.not_equal(merged[1:], merged[:-1], out=keep[1:])
        unique: np.ndarray = merged[keep]
        return unique


def encode(
    groups: Sequence[tuple[str, Sequence[tuple[int, int, int]]]],
    changed: Mapping[str, np.ndarray | None],
    sources: Mapping[str, np.ndarray],
    itemsizes: Mapping[str, int],
    capacity: int,
) -> np.ndarray | None:
    """The delta of one writer's part for one reader: ``groups`` are its ``(source buffer, [(src_off,
    region_off, nbytes), ...])`` runs; ``changed`` the changed elements per source buffer. None when a
    buffer's changes are unknown or the encoding would exceed ``capacity`` bytes (send in full then)."""
    parts: list[np.ndarray] = []
    size = 0
    for name, runs in groups:
        idx = changed.get(name)
        if idx is None:
            return None
        if not len(idx):
            continue
        itemsize = itemsizes[name]
        if len(runs) == 1:  # the usual whole-tensor buffer: one run, positions shift by a constant
            (s0, d0, n0), = runs
            lo, hi = np.searchsorted(idx, [s0 // itemsize, (s0 + n0) // itemsize])
            idx = idx[lo:hi]
            if not len(idx):
                continue
            element = idx.astype(np.int64) + (d0 - s0) // itemsize
        else:
            src = np.array([s for s, _, _ in runs], np.int64)
            order = np.argsort(src, kind="stable")
            src = src[order]
            dst = np.array([d for _, d, _ in runs], np.int64)[order]
            length = np.array([n for _, _, n in runs], np.int64)[order]
            at = idx.astype(np.int64) * itemsize
            k = np.searchsorted(src, at, side="right") - 1
            inside = (k >= 0) & (at < src[np.maximum(k, 0)] + length[np.maximum(k, 0)])
            at, k, idx = at[inside], k[inside], idx[inside]
            if not len(idx):
                continue
            element = (dst[k] + at - src[k]) // itemsize
        values = typed(sources[name], itemsize)[idx]
        if len(runs) > 1 and int(element.max()) - int(element.min()) >= _SPAN:  # several segments: sort to cut them
            order = np.argsort(element, kind="stable")
            element, values = element[order], values[order]
        start = 0
        while start < len(element):  # segments whose positions fit in uint32
            low = int(element[start:].min())
            stop = len(element) if int(element[start:].max()) - low < _SPAN else int(np.searchsorted(element, low + _SPAN, side="left"))
            count = stop - start
            pad = -(count * (4 + itemsize)) % 8
            size += _HEADER + count * (4 + itemsize) + pad
            if size > capacity:
                return None
            parts += [np.array([low, itemsize, count], np.int64).view(np.uint8),
                      (element[start:stop] - low).astype(np.uint32).view(np.uint8),
                      values[start:stop].view(np.uint8), np.zeros(pad, np.uint8)]
            start = stop
    return np.concatenate(parts) if parts else np.empty(0, np.uint8)


def apply(payload: np.ndarray, region: np.ndarray) -> int:
    """Write an ``encode``-d delta into ``region`` (``uint8``); the number of values written."""
    at = written = 0
    while at < len(payload):
        base, itemsize, count = (int(x) for x in payload[at : at + _HEADER].view(np.int64))
        at += _HEADER
        positions = payload[at : at + 4 * count].view(np.uint32)
        at += 4 * count
        values = payload[at : at + itemsize * count].view(_UINT[itemsize])
        at += itemsize * count + (-(count * (4 + itemsize)) % 8)
        if count and (base + int(positions.max())) * itemsize + itemsize > len(region):
            raise ValueError(f"delta segment at element {base} ({count} values) reaches past the {len(region)}-byte region")
        typed(region, itemsize)[base + positions.astype(np.int64)] = values
        written += count
    return written
