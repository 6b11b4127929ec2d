"""Delta versions: a writer sends only the values that changed since the version a reader's slot
holds, and the reader writes them into that slot.

RL updates are tiny (learning rates around 1e-6): from one step to the next a few percent of bf16
values change, scattered evenly, so nearly every 4 KiB block holds a change and sending changed
blocks saves little; positions + values do. Compactly: positions as gaps from the previous change,
values as the XOR of their old and new bits (a small step flips a few low mantissa bits: the XOR's
high byte is nearly always zero), each laid out byte plane by byte plane, then zstd (level 1), whose
Huffman stage squeezes the planes to about their entropy: about 1.3 bytes per changed bf16 value
(measured on AdamW steps: docs/benchmarks.md), against 6 for raw positions and values.

Finding the changes, the XOR, the gaps and the planes are torch ops on whatever device the bytes live
on (a GPU trainer does them on the GPU; CPU tests run the same lines). zstd runs on the host over the
already small planes, and so does its decoding on the reader, whose positions and values then go back
to the region's device: worth it on a slow link (``Transport.compress_deltas``: tcp), not on a fast one,
where the planes go as they are (about 6 bytes per changed bf16 value) and never leave the device (an
H100 compressed 4 GiB at 2 % changed in 1.9 s, while cuda_ipc sends all 4 GiB in 23 ms).

The encoding: ``int64 S``, then ``S`` segment headers ``int64 [base, itemsize, count, mode, nbytes]``,
then each segment's zstd frame (``nbytes``, padded to 8). A frame holds, before compression, ``count``
uint32 gaps (the first from element ``base`` of the reader's region; each later one from the previous
position, at least 1) as 4 byte planes, then ``count`` values of ``itemsize`` bytes as ``itemsize``
planes: the new bits (mode bit 1 clear) or their XOR with the bits the reader's slot holds (mode bit 1 set,
one step after the base: the XOR needs the base's bits, which the writer kept). Mode bit 2 set: the frame
is those planes as they are (``nbytes`` is exactly ``count * (4 + itemsize)``), not compressed. Equal bits, not equal floats: a
value is "changed" when its bytes differ, so the reader ends bit-exact (NaN payloads and -0.0 included).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch

#: share of a writer's bytes to a reader that the reader's inbox holds for its deltas; a larger
#: delta is sent in full (at about 1.3 bytes per changed bf16 value: up to ~35 % of the values changed)
INBOX_SHARE: Final = 0.25
#: a version with more of its elements changed than this is recorded as all of it (sent in full): its delta would not
#: fit an inbox (``INBOX_SHARE`` of the bytes, at 1.3 bytes or more per changed bf16 value), and its positions, 8
#: bytes each, would outgrow the model (a first step that moves every weight of 4 GiB of bf16: 16 GiB of them)
_DENSE: Final = 0.4
_SPAN: Final = 2**32
_HOST_SEGMENT: Final = 2**18  # values per segment on the host (1.5 MB of bf16 planes), and on a device
_DEVICE_SEGMENT: Final = 2**24
_CHUNK: Final = 2**20  # 64-bit words compared at a time (8 MiB of each side: the gathers hit the cache)
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

    ``together`` (default: for sources on a GPU): buffers are compared all at once, in a few flat copies of at
    most 2**28 elements each: two ops per buffer and two waits for the device per flat copy, where buffer by buffer
    costs six ops and a wait each (an H100 found 2 % of 4 GiB in 1622 tensors in 0.7 s that way, with the
    encoding). On the host, buffer by buffer and word by word keeps the compare in cache instead.

    A version that moved most elements (over ``_DENSE``) is recorded as all of it, and older versions are forgotten
    before the positions kept outgrow the copy: a step that moves every weight costs no memory beyond it.
    """

    def __init__(self, itemsizes: Mapping[str, int], depth: int = 4, together: bool | None = None) -> None:
        self._itemsizes = dict(itemsizes)
        self._depth = depth
        self._together = together
        self._shadow: dict[str, torch.Tensor] = {}
        self._history: list[tuple[int, dict[str, torch.Tensor | None]]] = []
        self._flips: dict[str, torch.Tensor] = {}  # of the newest version: old bits XOR new, per changed element
        self._flat_key: tuple[Any, ...] = ()  # the buffers compared together, as last laid out
        self._flat: list[_Flat] = []
        self._scratch = torch.empty(0, dtype=torch.int64)  # a host chunk's XOR, reused buffer after buffer

    def record(self, version: int, sources: Mapping[str, torch.Tensor]) -> None:
        """Compare ``sources`` (``uint8`` tensors) with the last recorded bytes and remember what changed; a version
        that changed more than ``_DENSE`` of the elements is remembered as all of it (sent in full)."""
        nows = {name: typed(raw, self._itemsizes[name]) for name, raw in sources.items()}
        together = {n: t for n, t in nows.items() if (t.is_cuda if self._together is None else self._together)}
        room = int(_DENSE * sum(now.numel() for now in nows.values()))  # positions kept at most
        found: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # a buffer not in it: all of it (unseen, or most moved)
        if together:
            room = self._record_together(together, found, room)
        for name, now in nows.items():
            if name in together:
                continue
            shadow = self._shadow.get(name)
            if shadow is None or shadow.numel() != now.numel() or shadow.device != now.device:
                self._shadow[name] = now.clone()  # never seen: all of it
            elif room < 0:  # most of the model moved: only the copy takes the new bits
                shadow.copy_(now)
            else:
                if self._scratch.numel() < _CHUNK and not now.is_cuda:
                    self._scratch = torch.empty(_CHUNK, dtype=torch.int64)
                found[name] = _changes(now, shadow, self._scratch)
                room -= found[name][0].numel()
                if room < 0:
                    found.clear()
        changes = {name: found[name][0] if name in found else None for name in nows}
        self._flips = {name: flips for name, (_, flips) in found.items()}
        self._history = [*self._history, (version, changes)][-self._depth :]
        # the oldest version is only ever a base (its changes are never read); past that, the positions kept stay
        # below the size of the copy compared against: a reader further behind than that gets the full version
        budget = sum(shadow.numel() * shadow.element_size() for shadow in self._shadow.values())
        while len(self._history) > 2 and _held(self._history[1:]) > budget:
            self._history.pop(0)
        self._history[0] = (self._history[0][0], {})

    def _record_together(self, nows: dict[str, torch.Tensor], found: dict[str, tuple[torch.Tensor, torch.Tensor]],
                         room: int) -> int:
        """``record`` for the buffers compared together: their changes into ``found``, or none and a negative room
        when more than ``room`` changed."""
        key = tuple((name, now.numel(), now.dtype, now.device) for name, now in nows.items())
        if key != self._flat_key:  # new buffers, or other sizes: laid out again, all of them "never seen"
            self._flat_key, self._flat = key, _Flat.lay_out(nows)
            for flat in self._flat:
                for name, view in flat.views.items():
                    self._shadow[name] = view
            return room
        for flat in self._flat:
            changes = flat.compare(nows, room)
            if changes is None:
                found.clear()
                room = -1
                continue
            found.update(changes)
            room -= sum(changed.numel() for changed, _ in changes.values())
        return room

    def flips(self, base: int, name: str) -> torch.Tensor | None:
        """The XOR of old and new bits of the elements ``since(base, name)`` lists, when ``base`` is the version
        just before the newest (one step, the usual delta); None otherwise (send the new bits then)."""
        if len(self._history) < 2 or self._history[-2][0] != base:
            return None
        return self._flips.get(name)

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


_FLAT_ELEMENTS: Final = 2**28  # elements compared at once when buffers are compared together (the mask: 256 MiB)


class _Flat:
    """Buffers of one element type on one device, their last recorded values side by side in one flat tensor."""

    def __init__(self, names: list[str], sizes: list[int], like: torch.Tensor, mask: torch.Tensor) -> None:
        self.starts = list(itertools.accumulate(sizes, initial=0))
        self.values = torch.empty(self.starts[-1], dtype=like.dtype, device=like.device)
        self.views = {n: self.values[a:b] for n, a, b in zip(names, self.starts, self.starts[1:])}
        self.mask = mask  # shared by the flats of one device: as large as the largest

    @classmethod
    def lay_out(cls, nows: dict[str, torch.Tensor]) -> list[_Flat]:
        """Flats of at most ``_FLAT_ELEMENTS`` each (a larger buffer alone), holding the values ``nows`` hold."""
        chunks: list[tuple[list[str], list[int], torch.Tensor]] = []
        kinds: dict[tuple[torch.dtype, torch.device], list[str]] = {}  # bf16 weights between fp32 norms: two flats
        for name, now in nows.items():
            kinds.setdefault((now.dtype, now.device), []).append(name)
        for names in kinds.values():
            for name in names:
                now = nows[name]
                if name == names[0] or sum(chunks[-1][1]) + now.numel() > _FLAT_ELEMENTS:
                    chunks.append(([], [], now))
                chunks[-1][0].append(name)
                chunks[-1][1].append(now.numel())
        masks: dict[torch.device, torch.Tensor] = {}
        for _, sizes, like in chunks:
            if like.device not in masks or masks[like.device].numel() < sum(sizes):
                masks[like.device] = torch.empty(sum(sizes), dtype=torch.bool, device=like.device)
        flats = [cls(names, sizes, like, masks[like.device]) for names, sizes, like in chunks]
        for flat in flats:
            torch._foreach_copy_(list(flat.views.values()), [nows[n] for n in flat.views])
        return flats

    def compare(self, nows: dict[str, torch.Tensor], room: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
        """Per buffer, the elements that differ from the last recorded values (sorted) and their old bits XOR new;
        None when more than ``room`` differ (counted first: no positions for a step that moved most weights). The
        flat takes the new values either way."""
        mask = self.mask[: self.starts[-1]]
        if room >= 0:
            for (name, view), at in zip(self.views.items(), self.starts):
                torch.ne(nows[name], view, out=mask[at : at + view.numel()])
        if room < 0 or int(mask.count_nonzero()) > room:  # with the positions below, the two waits for the device
            torch._foreach_copy_(list(self.views.values()), [nows[n] for n in self.views])
            return None
        idx = torch.nonzero(mask).flatten()
        old = self.values[idx]
        torch._foreach_copy_(list(self.views.values()), [nows[n] for n in self.views])
        flips = torch.bitwise_xor(old, self.values[idx])
        bounds = torch.searchsorted(idx, torch.tensor(self.starts, dtype=idx.dtype, device=idx.device)).tolist()
        out = {}
        for (name, at), lo, hi in zip(zip(self.views, self.starts), bounds, bounds[1:]):
            out[name] = (idx[lo:hi] - at if at else idx[lo:hi], flips[lo:hi])
        return out


def _held(history: Sequence[tuple[int, Mapping[str, torch.Tensor | None]]]) -> int:
    """Bytes of the positions ``history`` keeps."""
    return sum(t.numel() * t.element_size() for _, changes in history for t in changes.values() if t is not None)


def _changes(now: torch.Tensor, shadow: torch.Tensor, scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements where ``now`` and ``shadow`` (same-size integer tensors) differ, sorted, and their old bits XOR
    new; ``shadow`` takes the new bits. On the host, 64-bit words at a time, in chunks that stay in cache: the XOR of
    a chunk's words (into ``scratch``, ``_CHUNK`` int64 kept by the change log), ``nonzero`` over it (a quarter of the
    bf16 elements), one gather of the changed words' XOR and ``nonzero`` over their elements, then the chunk's new
    words copied whole (a scatter of the changed words touched half the cache lines anyway). 1 GB of bf16 at 2 %
    changed: 0.45 s on two host cores, was 0.6 s with a compare, two gathers and a scatter, and 1.0 s element by
    element. On a GPU, whose bandwidth the compare does not exhaust but whose every ``nonzero`` waits for the device,
    element by element: one wait per buffer."""
    per = 8 // now.element_size()
    whole = now.numel() // per * per
    if per == 1 or not whole or now.is_cuda or now.storage_offset() % per or shadow.storage_offset() % per:
        changed = torch.nonzero(now != shadow).flatten()
        new = now[changed]
        flips = torch.bitwise_xor(shadow[changed], new)
        shadow[changed] = new
        return changed, flips
    words, old_words = now[:whole].view(torch.int64), shadow[:whole].view(torch.int64)
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, words.numel(), _CHUNK):
        chunk, old = words[start : start + _CHUNK], old_words[start : start + _CHUNK]
        flipped = torch.bitwise_xor(chunk, old, out=scratch[: chunk.numel()])
        at = torch.nonzero(flipped).flatten()
        lanes = flipped[at].view(now.dtype)  # per changed word, its elements' flips
        old.copy_(chunk)
        lane = torch.nonzero(lanes).flatten()
        found.append((at[lane.div(per, rounding_mode="floor")].add_(start).mul_(per).add_(lane.remainder(per)), lanes[lane]))
    if whole < now.numel():  # the last few elements, past the last whole word
        tail, tail_flips = _changes(now[whole:], shadow[whole:], scratch)
        found.append((tail.add_(whole), tail_flips))
    return torch.cat([c for c, _ in found]), torch.cat([f for _, f in found])


def _elements(idx: torch.Tensor, runs: Sequence[tuple[int, int, int]], itemsize: int, nbytes: int) -> tuple[Any, torch.Tensor]:
    """Which of the changed source elements ``idx`` ``runs`` ``(src_off, region_off, nbytes)`` send (a selector of
    ``idx``), and the region elements they land on; ``nbytes``: the source buffer's size."""
    if len(runs) == 1:  # the usual whole-tensor buffer: one run, positions shift by a constant
        (s0, d0, n0), = runs
        if s0 == 0 and n0 >= nbytes // itemsize * itemsize:  # all of the buffer: every change, no search
            return slice(None), idx + d0 // itemsize if d0 else idx
        bounds = torch.tensor([s0 // itemsize, (s0 + n0) // itemsize], dtype=idx.dtype, device=idx.device)
        lo, hi = torch.searchsorted(idx, bounds).tolist()
        return slice(lo, hi), idx[lo:hi] + (d0 - s0) // itemsize
    table = torch.tensor(sorted(runs), dtype=torch.int64, device=idx.device).T.contiguous()  # sorted by source offset
    src, dst, length = table[0], table[1], table[2]
    at = idx * itemsize
    k = torch.searchsorted(src, at, right=True) - 1
    kc = k.clamp(min=0)
    inside = (k >= 0) & (at < src[kc] + length[kc])
    at, kc = at[inside], kc[inside]
    return inside, (dst[kc] + at - src[kc]) // itemsize


def _planes(values: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``values`` (``count`` integers of ``itemsize`` bytes or more) as byte planes: every element's low byte, then
    its next... Shifts and a narrowing copy (which keeps the low byte), not a transposing byte copy: about 10x
    faster for bf16 values on the host, the same on any device."""
    out = torch.empty((itemsize, values.numel()), dtype=torch.uint8, device=values.device)
    for k in range(itemsize):
        out[k].copy_(torch.bitwise_right_shift(values, 8 * k) if k else values)
    return out.reshape(-1)


def _unplanes(planes: torch.Tensor, itemsize: int) -> torch.Tensor:
    rows = planes.reshape(itemsize, -1)
    word = _WORD[itemsize]
    out = rows[0].to(word)
    for k in range(1, itemsize):
        out.bitwise_or_(rows[k].to(word).bitwise_left_shift_(8 * k))
    return out


def encode(
    groups: Sequence[tuple[str, Sequence[tuple[int, int, int]]]],
    changed: Mapping[str, torch.Tensor | None],
    sources: Mapping[str, torch.Tensor],
    itemsizes: Mapping[str, int],
    capacity: int,
    flips: Mapping[str, torch.Tensor | None] | None = None,
    compress: bool = True,
) -> torch.Tensor | None:
    """The delta of one writer's part for one reader, a ``uint8`` tensor (on the host when ``compress``, else on
    the sources' device): ``groups`` are its ``(source buffer, [(src_off, region_off, nbytes), ...])`` runs;
    ``changed`` the changed elements per source buffer; ``flips`` (``ChangeLog.flips``), where given, their old
    bits XOR new (sent instead of the new bits); ``compress``: zstd the frames (a slow link). None when a buffer's
    changes are unknown or the encoding would exceed ``capacity`` bytes (send in full then).

    The changes of every buffer of one item size go out as one stream of segments, cut by size, not by buffer (a
    model's 1600 tensors: on a GPU a few ops per tensor and the rest once per 2**24 values, instead of twenty ops
    and a frame per tensor; on the host cache-sized pieces). On a GPU it waits for the device only where a run or
    a span needs it (whole-tensor runs in a region of under 2**32 elements: never)."""
    classes: dict[tuple[int, bool], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for name, runs in groups:
        idx = changed.get(name)
        if idx is None:
            return None
        if not idx.numel():
            continue
        itemsize = itemsizes[name]
        flipped = None if flips is None else flips.get(name)
        chosen, element = _elements(idx, runs, itemsize, sources[name].numel())
        if not element.numel():
            continue
        values = flipped[chosen] if flipped is not None else typed(sources[name], itemsize)[idx[chosen]]
        if len(runs) > 1:  # runs may land out of order: gaps need the positions sorted
            element, order = torch.sort(element, stable=True)
            values = values[order]
        low, high = min(d for _, d, _ in runs) // itemsize, -(-max(d + n for _, d, n in runs) // itemsize)
        classes.setdefault((itemsize, flipped is not None), []).append((low, high, element, values))
    headers: list[int] = []
    frames: list[torch.Tensor] = []  # each frame, then its padding to 8, back to back
    size = 8
    for (itemsize, xor), found in classes.items():
        ordered = _in_region_order(found)
        mode = (1 if xor else 0) | (0 if compress else 2)
        for low, start, stop in _segments(ordered, found[0][0], max(h for _, h, _, _ in found)):
            count = stop - start
            if not compress and size + 40 + count * (4 + itemsize) > capacity:  # known before the planes are made
                return None
            element, values = ordered.take(start, stop)
            positions = element - low
            gaps = torch.diff(positions, prepend=positions.new_zeros(1)).to(torch.int32)  # < 2**32: the low word kept
            planes = torch.cat([_planes(gaps, 4), _planes(values, itemsize)])
            frame = torch.frombuffer(bytearray(_zstd().compress(planes.cpu().numpy(), level=1)), dtype=torch.uint8) \
                if compress else planes
            size += 40 + frame.numel() + _pad8(frame.numel())
            if size > capacity:
                return None
            headers += [low, itemsize, count, mode, frame.numel()]
            frames += [frame, frame.new_zeros(_pad8(frame.numel()))]
    if not headers:
        return torch.empty(0, dtype=torch.uint8)
    head = torch.tensor([len(headers) // 5, *headers], dtype=torch.int64).view(torch.uint8)
    return torch.cat([head.to(frames[0].device), *frames])


class _Joined:
    """Several buffers' positions and values, one part after another, read as one sorted sequence without being
    joined: a segment takes its slices of the parts it covers (joining a model's 300 tensors' positions, 85 MB at
    2 % changed, cost 0.1 s a version on the host)."""

    def __init__(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.parts = parts
        self.starts = list(itertools.accumulate((element.numel() for element, _ in parts), initial=0))
        self.device = parts[0][0].device

    def numel(self) -> int:
        return self.starts[-1]

    def take(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions and values ``start:stop`` of the whole sequence."""
        index = bisect.bisect_right(self.starts, start) - 1
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        while start < stop:
            first, end = self.starts[index], self.starts[index + 1]
            element, values = self.parts[index]
            lo, hi = start - first, min(stop, end) - first
            pieces.append((element[lo:hi], values[lo:hi]))
            start, index = first + hi, index + 1
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([e for e, _ in pieces]), torch.cat([v for _, v in pieces])

    def whole(self) -> torch.Tensor:
        """All positions, joined (for regions past 2**32 elements, whose segments are cut by position)."""
        return self.parts[0][0] if len(self.parts) == 1 else torch.cat([element for element, _ in self.parts])


def _in_region_order(found: list[tuple[int, int, torch.Tensor, torch.Tensor]]) -> _Joined:
    """The positions (each buffer's sorted) and values of several buffers, as one sequence sorted by position.
    ``found``: ``(first, end, positions, values)`` per buffer, sorted here by ``first``. Buffers whose region spans
    do not overlap (whole tensors, each its own part of the region) follow each other in that order as they are;
    spans that interleave (a buffer's runs around another's) are joined and sorted on the device."""
    found.sort(key=lambda part: part[0])
    ends = itertools.accumulate((part[1] for part in found), max)  # the furthest any earlier span reaches
    if not any(part[0] < reach for part, reach in zip(found[1:], ends)):
        return _Joined([(part[2], part[3]) for part in found])
    element, order = torch.sort(torch.cat([part[2] for part in found]), stable=True)
    return _Joined([(element, torch.cat([part[3] for part in found])[order])])


def _segments(ordered: _Joined, first: int, end: int) -> list[tuple[int, int, int]]:
    """``(low, start, stop)``: positions ``start:stop`` of ``ordered`` (sorted region elements, all in
    ``[first, end)``) in segments whose positions from ``low`` fit in uint32, of at most ``_segment_values`` values.
    A span under 2**32 needs no look at the positions (no wait for the device): every segment counts from
    ``first``."""
    cap, count = _segment_values(ordered.device), ordered.numel()
    if end - first <= _SPAN:
        return [(first, at, min(at + cap, count)) for at in range(0, count, cap)]
    element = ordered.whole()
    out, start = [], 0
    high = int(element[-1])
    while start < count:
        low = int(element[start])
        stop = count if high - low < _SPAN else int(torch.searchsorted(element, low + _SPAN))
        out += [(low, at, min(at + cap, stop)) for at in range(start, stop, cap)]
        start = stop
    return out


def _segment_values(device: torch.device) -> int:
    """Values per segment: on the host few enough that a segment's planes and positions stay in cache while a dozen
    ops pass over them (one segment of 11 M values applied in 0.8 s where 400 small ones took 0.4 s, 2 cores); on
    a GPU many, so that the ops per segment are few against the values."""
    return _HOST_SEGMENT if device.type == "cpu" else _DEVICE_SEGMENT


@functools.cache
def _zstd() -> Any:
    """Python's own zstd (3.14+), or its backport, the same module (``backports.zstd``, a dependency below 3.14)."""
    try:
        from compression import zstd  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        from backports import zstd  # type: ignore[no-redef, unused-ignore]
    return zstd


def apply(payload: torch.Tensor, region: torch.Tensor) -> int:
    """Write an ``encode``-d delta into ``region`` (``uint8``, any device; XOR segments XOR into the bits it
    holds); the number of values written. Checks the values all segments claim against the region, then decodes and
    checks every segment before writing any (a bad delta raises ``ValueError`` and changes nothing). Uncompressed frames are decoded where the payload is
    (on a GPU: on the device, one wait for all the checks)."""
    if not payload.numel():
        return 0
    if payload.numel() < 8:
        raise ValueError(f"a {payload.numel()}-byte delta has no segment count")
    segments = int(payload[:8].cpu().view(torch.int64))
    if segments < 0 or 8 + 40 * segments > payload.numel():
        raise ValueError(f"a {payload.numel()}-byte delta cannot hold {segments} segment headers")
    headers = payload[8 : 8 + 40 * segments].cpu().view(torch.int64).reshape(-1, 5).tolist()
    # the whole frame bounded before any segment is decoded: every value lands on its own element of the region, so
    # all segments together hold at most the region's bytes (a lying count cannot make each segment decode to it)
    claimed = sum(count * itemsize for _, itemsize, count, _, _ in headers if itemsize in _WORD and count > 0)
    if claimed > region.numel():
        raise ValueError(f"a delta of {segments} segments claims {claimed} bytes of values, more than the "
                         f"{region.numel()}-byte region holds")
    at = 8 + 40 * segments
    parts: list[tuple[int, torch.Tensor, torch.Tensor, int, int]] = []
    for base, itemsize, count, mode, nbytes in headers:
        if itemsize not in _WORD or count < 1 or base < 0 or mode not in (0, 1, 2, 3) or nbytes < 0:
            raise ValueError(f"delta segment header [{base}, {itemsize}, {count}, {mode}, {nbytes}] is not a segment")
        end = at + nbytes + _pad8(nbytes)
        if end > payload.numel():
            raise ValueError(f"delta segment at element {base} ({count} values) runs past the {payload.numel()}-byte delta")
        if count * itemsize > region.numel():  # unique positions: at most one value per element of the region
            raise ValueError(f"a delta segment ({count} values) reaches past the {region.numel()}-byte region")
        expected = count * (4 + itemsize)
        if mode & 2:  # the planes as they are
            if nbytes != expected:
                raise ValueError(f"delta segment at element {base}: {nbytes} bytes of planes, {expected} for {count} values")
            raw = payload[at : at + nbytes].to(region.device)
        else:
            raw = torch.frombuffer(bytearray(_decompress(payload[at : at + nbytes], base, expected)), dtype=torch.uint8)
            raw = raw.to(region.device)
        gaps = _unplanes(raw[: 4 * count], 4).to(torch.int64) & 0xFFFFFFFF
        parts.append((base, torch.cumsum(gaps, 0).add_(base), _unplanes(raw[4 * count :], itemsize), itemsize, mode & 1))
        at = end
    if not parts:
        return 0
    # strictly increasing positions (unique: no write races on a GPU), the last within the region: one read
    checks = torch.stack([torch.stack([p[1:].le(p[:-1]).any().to(torch.int64), p[-1]]) for _, p, _, _, _ in parts]).tolist()
    for (base, positions, values, itemsize, _), (repeats, last) in zip(parts, checks):
        if repeats:
            raise ValueError(f"delta segment at element {base}: positions are not increasing")
        if (last + 1) * itemsize > region.numel():
            raise ValueError(f"a delta segment ({values.numel()} values) reaches past the {region.numel()}-byte region")
    for _, positions, values, itemsize, xor in parts:
        target = typed(region, itemsize)
        target.index_copy_(0, positions, torch.bitwise_xor(target[positions], values) if xor else values)
    return sum(v.numel() for _, _, v, _, _ in parts)


def _decompress(frame: torch.Tensor, base: int, expected: int) -> bytes:
    """A segment's zstd frame, decompressed: exactly ``expected`` bytes, or ``ValueError``."""
    zstd = _zstd()
    data = frame.cpu().numpy().tobytes()
    try:  # one frame that says its size and is exactly that: a lying frame cannot make the reader allocate more
        if zstd.get_frame_info(data).decompressed_size != expected or zstd.get_frame_size(data) != len(data):
            raise ValueError("another size")
        unpack = zstd.ZstdDecompressor()
        planes: bytes = unpack.decompress(data, max_length=expected)
        if len(planes) != expected or not unpack.eof:
            raise ValueError("another size")
    except (zstd.ZstdError, ValueError) as exc:
        raise ValueError(f"delta segment at element {base}: not a zstd frame of {expected} bytes ({exc})") from None
    return planes
