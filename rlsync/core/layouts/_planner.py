"""The transfer planner: from a source layout and a destination layout, a static plan.

Every destination element comes from exactly one source element (zero redundancy). Where
several source ranks hold an element (data-parallel replicas), the planner picks the holder
so that the most loaded sender carries as little as possible: pieces only one rank holds are
counted first, then shared pieces go, largest first, to their least loaded holder (LPT). The
assignment is a pure function of the two layouts, so every rank that builds the plan gets the
same one, and a rank can materialize just its own transfers (``dst_ranks=[r]``) while the
cheap assignment pass still sees all pieces.

Adjacent pieces between the same pair of buffers that are contiguous on both sides are merged
into one transfer. A plan carries fingerprints of both layouts and refuses others.
"""

from __future__ import annotations

import difflib

import gc
import time
from collections.abc import Iterable, Sequence
from typing import final

import msgspec
import numpy as np

from rlsync.core._errors import LayoutError, PlanError, PlanMismatchError
from rlsync.core.layouts._layout import Box, Layout, Shard, TensorMeta, dtype_size, tensor_fingerprints
from rlsync.core.layouts._transfer import Transfer


@final
class PlanStats(msgspec.Struct, frozen=True):
    """Sizes and balance of a plan (bytes unless named otherwise)."""

    bytes_needed: int
    bytes_sent: int
    transfers: int
    senders: int
    receivers: int
    max_sender_bytes: int
    max_receiver_bytes: int
    sender_lower_bound: int
    build_seconds: float

    @property
    def redundancy(self) -> float:
        return self.bytes_sent / self.bytes_needed if self.bytes_needed else 1.0

    @property
    def imbalance(self) -> float:
        return self.max_sender_bytes / self.sender_lower_bound if self.sender_lower_bound else 1.0

    def predicted_seconds(self, nic_gbps: float) -> float:
        """Time if every sender and receiver NIC moves ``nic_gbps`` Gbit/s: the worse bottleneck."""
        return max(self.max_sender_bytes, self.max_receiver_bytes) * 8 / (nic_gbps * 1e9)


@final
class Plan(msgspec.Struct, frozen=True):
    """Transfers from one layout to another, and the fingerprints of both."""

    src_fingerprint: str
    dst_fingerprint: str
    transfers: tuple[Transfer, ...]
    stats: PlanStats
    #: per-tensor fingerprints of both layouts, to name what differs when a plan is refused
    src_tensors: dict[str, str] = {}
    dst_tensors: dict[str, str] = {}
    #: destination ranks whose transfers this plan holds (None: all)
    dst_ranks: tuple[int, ...] | None = None

    def for_src_rank(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.src_rank == rank]

    def for_dst_rank(self, rank: int) -> list[Transfer]:
        if self.dst_ranks is not None and rank not in self.dst_ranks:
            raise PlanError(f"this plan was built for destination ranks {self.dst_ranks}, not {rank}")
        return [t for t in self.transfers if t.dst_rank == rank]

    def check(self, src: Layout, dst: Layout) -> None:
        """Refuse layouts other than the ones the plan was built for, naming the first differing tensor."""
        for side, layout, expected, before in (
            ("source", src, self.src_fingerprint, self.src_tensors),
            ("destination", dst, self.dst_fingerprint, self.dst_tensors),
        ):
            if layout.fingerprint() == expected:
                continue
            now = tensor_fingerprints(layout)
            first = next((n for n in [*before, *now] if before.get(n) != now.get(n)), None)
            if first is None:
                what = "its buffers differ"
            elif first in now and first in before:
                what = f"tensor {first!r} differs (shape, dtype or shards)"
            else:
                what = f"tensor {first!r} is {'new' if first in now else 'missing'}"
            raise PlanMismatchError(
                f"this plan was built for another {side} layout: {what}. Rebuild the plan with build_plan()."
            )


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def validate_layout(layout: Layout, side: str, ranks: frozenset[int] | None = None) -> None:
    """Boxes inside their tensors, shards inside their buffers, buffers of the tensors' dtype."""
    metas = layout.tensor_map()
    buffers = {(b.rank, b.name): b for b in layout.buffers}
    in_bounds: set[tuple[str, Box]] = set()
    for s in layout.shards:
        if ranks is not None and s.rank not in ranks:
            continue
        meta = metas.get(s.tensor)
        if meta is None:
            raise LayoutError(f"{side} shard on rank {s.rank} names unknown tensor {s.tensor!r}")
        if (s.tensor, s.box) not in in_bounds:
            if len(s.box.sizes) != len(meta.shape) or not s.box.within(meta.shape):
                raise LayoutError(
                    f"{side} tensor {s.tensor!r} on rank {s.rank}: box offsets {s.box.offsets} sizes {s.box.sizes} "
                    f"is outside its shape {meta.shape}"
                )
            in_bounds.add((s.tensor, s.box))
        buf = buffers.get((s.rank, s.buffer))
        if buf is None:
            raise LayoutError(f"{side} tensor {s.tensor!r} on rank {s.rank}: unknown buffer {s.buffer!r}")
        if buf.dtype != meta.dtype:
            raise LayoutError(
                f"{side} tensor {s.tensor!r} ({meta.dtype}) on rank {s.rank} lives in buffer {s.buffer!r} of dtype {buf.dtype}"
            )
        if s.box.numel:
            last = s.offset + sum((n - 1) * st for n, st in zip(s.box.sizes, s.strides))
            if s.offset < 0 or last >= buf.numel:
                raise LayoutError(
                    f"{side} tensor {s.tensor!r} on rank {s.rank}: elements {s.offset}..{last} overflow "
                    f"buffer {s.buffer!r} of {buf.numel} elements"
                )


def _listed(names: Sequence[str], shown: int = 5) -> str:
    return ", ".join(repr(n) for n in names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _prefix_hint(missing: Sequence[str], extra: Sequence[str]) -> str:
    """A prefix the trainer's names carry and the engine's lack (or the other way), when it explains every miss."""
    for have, want, side in ((extra, missing, "the trainer's"), (missing, extra, "the engine's")):
        for name in have[:1]:
            for want_name in want:
                if name.endswith(want_name) and name != want_name:
                    prefix = name[: len(name) - len(want_name)]
                    if all(h.startswith(prefix) and h[len(prefix):] in set(want) for h in have):
                        return f" {side} names carry the prefix {prefix!r} that the others lack: strip it (or add it) before export."
    return ""


def _check_tensors(src: Layout, dst: Layout) -> dict[str, TensorMeta]:
    smeta, dmeta = src.tensor_map(), dst.tensor_map()
    missing = sorted(dmeta.keys() - smeta.keys())
    if missing:
        extra = sorted(smeta.keys() - dmeta.keys())
        near = {m: difflib.get_close_matches(m, extra, n=1, cutoff=0.6) for m in missing[:3]}
        nearest = "; ".join(f"{m!r} ~ {n[0]!r}" for m, n in near.items() if n)
        raise PlanError(f"{len(missing)} destination tensor(s) the trainer does not export: {_listed(missing)}. "
                        f"The trainer exports {len(smeta)}, e.g. {_listed(sorted(smeta), 3)}"
                        + (f"; {len(extra)} of them the engine does not have: {_listed(extra, 3)}" if extra else "")
                        + "." + (f" Nearest names: {nearest}." if nearest else "") + _prefix_hint(missing, extra))
    for name, d in dmeta.items():
        s = smeta[name]
        if s.dtype != d.dtype:
            raise PlanError(f"tensor {name!r}: source dtype {s.dtype} != destination dtype {d.dtype}; cast before export")
        if s.shape != d.shape:
            raise PlanError(f"tensor {name!r}: source shape {s.shape} != destination shape {d.shape}")
    return dmeta


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def _place(shard: Shard, box: Box) -> int:
    return shard.offset + sum((b - o) * st for b, o, st in zip(box.offsets, shard.box.offsets, shard.strides))


def _linear(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    expect = 1
    for n, st in zip(reversed(sizes), reversed(strides)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _transfer(name: str, itemsize: int, box: Box, src: Shard, dst: Shard) -> Transfer:
    s_off, d_off = _place(src, box), _place(dst, box)
    if _linear(box.sizes, src.strides) and _linear(box.sizes, dst.strides):
        n = box.numel
        return Transfer(name, (n,), itemsize, src.rank, src.buffer, s_off, (1,), dst.rank, dst.buffer, d_off, (1,))
    return Transfer(name, box.sizes, itemsize, src.rank, src.buffer, s_off, src.strides, dst.rank, dst.buffer, d_off, dst.strides)


def _coalesce(transfers: list[Transfer]) -> list[Transfer]:
    """Merge runs of 1-D transfers that continue each other in both buffers."""
    transfers.sort(key=lambda t: (t.src_rank, t.dst_rank, t.src_buffer, t.dst_buffer, t.src_offset))
    out: list[Transfer] = []
    for t in transfers:
        if out:
            p = out[-1]
            if (
                len(p.sizes) == 1 and len(t.sizes) == 1 and p.itemsize == t.itemsize
                and p.src_rank == t.src_rank and p.dst_rank == t.dst_rank
                and p.src_buffer == t.src_buffer and p.dst_buffer == t.dst_buffer
                and p.src_offset + p.sizes[0] == t.src_offset and p.dst_offset + p.sizes[0] == t.dst_offset
            ):
                out[-1] = Transfer(p.tensor, (p.sizes[0] + t.sizes[0],), p.itemsize, p.src_rank, p.src_buffer,
                                   p.src_offset, (1,), p.dst_rank, p.dst_buffer, p.dst_offset, (1,))
                continue
        out.append(t)
    return out


def _lower_bound(unique: dict[int, int], shared: list[tuple[int, tuple[int, ...]]], senders: Iterable[int]) -> int:
    """Bytes some set of senders must carry alone, per sender: over connected groups of ranks that
    share pieces, (their unique bytes + the pieces only they hold) / their count."""
    parent = {r: r for r in senders}

    def find(r: int) -> int:
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    seen: set[tuple[int, ...]] = set()
    for _, holders in shared:
        if holders in seen:
            continue
        seen.add(holders)
        root = find(holders[0])
        for h in holders[1:]:
            parent[find(h)] = root
    total: dict[int, int] = {}
    count: dict[int, int] = {}
    for r in parent:
        root = find(r)
        total[root] = total.get(root, 0) + unique.get(r, 0)
        count[root] = count.get(root, 0) + 1
    for nbytes, holders in shared:
        root = find(holders[0])
        total[root] += nbytes
    return max((-(-total[r] // count[r]) for r in total), default=0)


def _overlaps(a: Sequence[Box], b: Sequence[Box]) -> Iterable[tuple[int, int, Box]]:
    """All overlapping pairs ``(i, j, a[i] ∩ b[j])``; vectorized, since a tensor can have
    dozens of source boxes and dozens of destination boxes but each overlaps only a few."""
    if len(a) * len(b) <= 16 or not a[0].sizes:
        for i, x in enumerate(a):
            for j, y in enumerate(b):
                inter = x.intersect(y)
                if inter is not None:
                    yield i, j, inter
        return
    alo = np.array([x.offsets for x in a], dtype=np.int64)
    ahi = alo + np.array([x.sizes for x in a], dtype=np.int64)
    blo = np.array([y.offsets for y in b], dtype=np.int64)
    bhi = blo + np.array([y.sizes for y in b], dtype=np.int64)
    lo = np.maximum(alo[:, None, :], blo[None, :, :])
    hi = np.minimum(ahi[:, None, :], bhi[None, :, :])
    hit = (hi > lo).all(axis=2)
    for i, j in zip(*np.nonzero(hit)):
        l, h = lo[i, j].tolist(), hi[i, j].tolist()
        yield int(i), int(j), Box(tuple(l), tuple(x - y for x, y in zip(h, l)))


def build_plan(src: Layout, dst: Layout, *, dst_ranks: Iterable[int] | None = None) -> Plan:
    """Plan the transfers that fill ``dst`` from ``src`` (only those landing on ``dst_ranks`` if given)."""
    # Planning allocates hundreds of thousands of small objects and frees none of them in
    # cycles: the cyclic garbage collector would only rescan them over and over.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _build_plan(src, dst, dst_ranks)
    finally:
        if enabled:
            gc.enable()


_Class = tuple[int, Box, list[Shard], list[Shard]]  # (piece bytes, piece, the source shards holding it, dst shards)


def _build_plan(src: Layout, dst: Layout, dst_ranks: Iterable[int] | None) -> Plan:
    started = time.perf_counter()
    wanted = None if dst_ranks is None else frozenset(dst_ranks)
    validate_layout(src, "source")
    validate_layout(dst, "destination", wanted)
    metas = _check_tensors(src, dst)
    classes = _classes(dst, _source_groups(src), metas)
    picks, unique, shared_info, load = _assign(src, classes)
    transfers, recv = _transfers(classes, picks, wanted)
    sent: dict[int, int] = {}
    for t in transfers:
        sent[t.src_rank] = sent.get(t.src_rank, 0) + t.nbytes
    stats = PlanStats(
        bytes_needed=sum(recv.values()),
        bytes_sent=sum(sent.values()),
        transfers=len(transfers),
        senders=len(sent),
        receivers=len(recv),
        max_sender_bytes=max(sent.values(), default=0),
        max_receiver_bytes=max(recv.values(), default=0),
        sender_lower_bound=_lower_bound(unique, shared_info, load) if wanted is None else 0,
        build_seconds=0.0,
    )
    return Plan(
        src.fingerprint(), dst.fingerprint(), tuple(transfers),
        msgspec.structs.replace(stats, build_seconds=time.perf_counter() - started),
        tensor_fingerprints(src), tensor_fingerprints(dst),
        None if wanted is None else tuple(sorted(wanted)),
    )


def _source_groups(src: Layout) -> dict[str, dict[Box, list[Shard]]]:
    """Source boxes per tensor, each with the shards (ranks) that hold it, sorted by rank."""
    groups: dict[str, dict[Box, list[Shard]]] = {}
    for s in src.shards:
        groups.setdefault(s.tensor, {}).setdefault(s.box, []).append(s)
    src_metas = src.tensor_map()
    for name, boxes in groups.items():
        if sum(b.numel for b in boxes) > src_metas[name].numel:
            raise LayoutError(f"source shards of tensor {name!r} overlap partially; replicas must hold identical boxes")
        for shards in boxes.values():
            shards.sort(key=lambda s: s.rank)
    return groups


def _classes(dst: Layout, groups: dict[str, dict[Box, list[Shard]]], metas: dict[str, TensorMeta]) -> list[_Class]:
    """Destination replicas hold identical boxes: each distinct box is intersected once. A class is one intersection
    piece, the source box holding it, and every destination shard that needs it."""
    replicas: dict[tuple[str, Box], list[Shard]] = {}
    for d in dst.shards:
        replicas.setdefault((d.tensor, d.box), []).append(d)
    by_tensor: dict[str, list[Box]] = {}
    for name, box in replicas:
        by_tensor.setdefault(name, []).append(box)
    classes: list[_Class] = []
    for name, dboxes in by_tensor.items():
        size = dtype_size(metas[name].dtype)
        sgroups = groups.get(name, {})
        sboxes = list(sgroups)
        covered = [0] * len(dboxes)
        for i, j, inter in _overlaps(sboxes, dboxes):
            dshards = replicas[(name, dboxes[j])]
            classes.append((inter.numel * size, inter, sgroups[sboxes[i]], dshards))
            covered[j] += inter.numel
        for j, box in enumerate(dboxes):
            if covered[j] != box.numel:
                d = replicas[(name, box)][0]
                raise PlanError(
                    f"tensor {name!r}: destination rank {d.rank} needs box offsets {box.offsets} sizes {box.sizes}, "
                    f"but the source shards cover {covered[j]} of its {box.numel} elements"
                    + (" (source shards overlap)" if covered[j] > box.numel else "; no source rank holds the rest")
                )
    return classes


def _assign(src: Layout, classes: list[_Class]) -> tuple[dict[int, list[Shard]], dict[int, int],
                                                           list[tuple[int, tuple[int, ...]]], dict[int, int]]:
    """Pieces one rank holds load it first; shared pieces go, largest first, to their least loaded holders, the
    destinations of one piece spread over its holders. Returns the picks (by class id), the load of unique pieces,
    the shared pieces' (bytes, holders) and the final load per rank."""
    load: dict[int, int] = {s.rank: 0 for s in src.shards}
    shared = []
    for cls in classes:
        nbytes, _, holders, dshards = cls
        if len(holders) == 1:
            load[holders[0].rank] += nbytes * len(dshards)
        else:
            shared.append(cls)
    unique = dict(load)
    shared.sort(key=lambda c: -c[0] * len(c[3]))
    picks: dict[int, list[Shard]] = {}
    shared_info: list[tuple[int, tuple[int, ...]]] = []
    for cls in shared:
        nbytes, _, holders, dshards = cls
        order = sorted(holders, key=lambda s: load[s.rank])
        chosen = [order[j % len(order)] for j in range(len(dshards))]
        for s in chosen:
            load[s.rank] += nbytes
        picks[id(cls)] = chosen
        shared_info.append((nbytes * len(dshards), tuple(s.rank for s in holders)))
    return picks, unique, shared_info, load


def _transfers(classes: list[_Class], picks: dict[int, list[Shard]],
               wanted: frozenset[int] | None) -> tuple[list[Transfer], dict[int, int]]:
    """Every destination shard's pieces from their picked holders (coalesced), and the bytes each rank receives."""
    transfers: list[Transfer] = []
    recv: dict[int, int] = {}
    for cls in classes:
        nbytes, inter, holders, dshards = cls
        picked = picks.get(id(cls))
        size = nbytes // inter.numel if inter.numel else 0
        for j, d in enumerate(dshards):
            if wanted is not None and d.rank not in wanted:
                continue
            source = holders[0] if picked is None else picked[j]
            transfers.append(_transfer(d.tensor, size, inter, source, d))
            recv[d.rank] = recv.get(d.rank, 0) + nbytes
    return _coalesce(transfers), recv
