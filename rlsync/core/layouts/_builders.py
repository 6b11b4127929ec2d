"""Layout builders for the ways trainers and engines hold weights.

Generic builders (any tensor list): ``replicated``, ``from_state_dict``, ``fsdp`` (DTensor
``Shard(dim)``), ``zero3`` (DeepSpeed ZeRO-3 flat partitions), ``data_parallel`` (replicas of any
layout). Model-aware builders that need each tensor's role live in ``_layout_parallel``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlsync.core._errors import LayoutError, whole_number
from rlsync.core.layouts._layout import (
    Box,
    BufferSpec,
    Layout,
    Shard,
    TensorMeta,
    contiguous_strides,
    dtype_name,
    make_layout,
)


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` semantics: chunks of ``ceil(n / parts)``; the last ones may be short or empty."""
    size = -(-n // parts) if parts else 0
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def even_bounds(n: int, parts: int, what: str) -> list[tuple[int, int]]:
    """Equal chunks; tensor/expert parallelism requires the size to divide evenly."""
    if parts <= 0 or n % parts:
        raise LayoutError(f"{what}: size {n} does not split evenly into {parts} parts")
    size = n // parts
    return [(i * size, (i + 1) * size) for i in range(parts)]


def slice_box(shape: Sequence[int], dim: int, lo: int, hi: int) -> Box:
    offsets = [0] * len(shape)
    sizes = list(shape)
    offsets[dim] = lo
    sizes[dim] = hi - lo
    return Box(tuple(offsets), tuple(sizes))


def own_buffer_shard(meta: TensorMeta, box: Box, rank: int, buffer: str | None = None) -> Shard:
    """A shard stored contiguously in a buffer of its own (the usual local parameter)."""
    return Shard(meta.name, box, rank, buffer or meta.name, 0, contiguous_strides(box.sizes))


def metas_of(state: Mapping[str, Any] | Iterable[TensorMeta]) -> list[TensorMeta]:
    """TensorMetas of a ``{name: tensor}`` dict (anything with ``dtype`` and ``shape``) or a list of metas."""
    if isinstance(state, Mapping):
        return [TensorMeta(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in state.items()]
    return list(state)


def tied_aliases(state: Mapping[str, Any]) -> set[str]:
    """Names in a ``{name: tensor}`` dict whose tensor is an earlier one's memory under a second name (a tied
    model's ``lm_head.weight`` in its ``state_dict()``): same storage, offset, shape, strides and dtype. Send the
    first name only; the engine's model ties the rest itself."""
    seen: set[tuple[Any, ...]] = set()
    aliases = set()
    for name, tensor in state.items():
        key = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        if key in seen and tensor.numel():
            aliases.add(name)
        seen.add(key)
    return aliases


def replicated(tensors: Iterable[TensorMeta], ranks: Sequence[int] = (0,)) -> Layout:
    """Every rank holds every tensor whole, each in a buffer named after the tensor."""
    tensors = list(tensors)
    ranks = [whole_number("rank", r, 0) for r in ranks]
    shards = [own_buffer_shard(t, Box.full(t.shape), r) for r in ranks for t in tensors]
    return make_layout(tensors, shards)


def from_state_dict(state: Mapping[str, Any] | Iterable[TensorMeta], rank: int = 0) -> Layout:
    """One rank holding a plain ``{name: tensor}`` state dict (transformers, a single process)."""
    return replicated(metas_of(state), (rank,))


def fsdp(tensors: Iterable[TensorMeta], world: int, dim: int = 0) -> Layout:
    """FSDP2 / DTensor ``Shard(dim)``: each tensor split along ``dim`` as ``torch.chunk`` does,
    so the last shard may be shorter (uneven) and trailing ranks may hold nothing of a small tensor."""
    world = whole_number("world", world, 1)
    tensors = list(tensors)
    shards = []
    for t in tensors:
        if not t.shape:
            shards.append(own_buffer_shard(t, Box.full(()), 0))
            continue
        for rank, (lo, hi) in enumerate(chunk_bounds(t.shape[dim], world)):
            if hi > lo:
                shards.append(own_buffer_shard(t, slice_box(t.shape, dim, lo, hi), rank))
    return make_layout(tensors, shards)


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose the flat element range ``[start, stop)`` of a row-major tensor into boxes."""
    if stop <= start:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    first_row, last_row = start // inner, (stop - 1) // inner
    if first_row == last_row:
        lo, hi = start - first_row * inner, stop - first_row * inner
        return [Box((first_row, *b.offsets), (1, *b.sizes)) for b in flat_range_boxes(rest, lo, hi)]
    boxes: list[Box] = []
    full_lo = first_row
    if start % inner:
        boxes += flat_range_boxes(shape, start, (first_row + 1) * inner)
        full_lo += 1
    full_hi = stop // inner
    if full_hi > full_lo:
        boxes.append(Box((full_lo,) + (0,) * len(rest), (full_hi - full_lo, *rest)))
    if stop % inner:
        boxes += flat_range_boxes(shape, full_hi * inner, stop)
    return boxes


def zero3(tensors: Iterable[TensorMeta], world: int) -> Layout:
    """DeepSpeed ZeRO-3: each parameter is flattened, padded to a multiple of ``world`` and split
    into equal partitions; a rank keeps its partitions of all parameters back to back in one flat
    buffer per dtype (``zero3.flat.<dtype>``), as ``fp16_partitioned_groups_flat`` does."""
    world = whole_number("world", world, 1)
    tensors = list(tensors)
    shards: list[Shard] = []
    used: dict[str, int] = {}
    for t in tensors:
        part = -(-t.numel // world)
        base = used.get(t.dtype, 0)
        strides = contiguous_strides(t.shape)
        for rank in range(world):
            lo, hi = min(rank * part, t.numel), min((rank + 1) * part, t.numel)
            for box in flat_range_boxes(t.shape, lo, hi):
                flat = sum(o * s for o, s in zip(box.offsets, strides))
                shards.append(Shard(t.name, box, rank, f"zero3.flat.{t.dtype}", base + flat - lo, strides))
        used[t.dtype] = base + part
    buffers = [BufferSpec(r, f"zero3.flat.{dt}", dt, n) for r in range(world) for dt, n in used.items()]
    return make_layout(tensors, shards, buffers)


def flat_partitions(tensors: Iterable[TensorMeta], world: int) -> Layout:
    """Each tensor flattened and cut into ``world`` parts of ``ceil(numel / world)`` elements (the last
    shorter, trailing ranks maybe empty); rank ``r``'s buffer ``name`` holds part ``r``, contiguous. This is
    one DeepSpeed ZeRO-3 parameter's ``ds_tensor`` on each rank (its padding left out), and the way to split a
    replicated state (ZeRO-1/2, DDP) so that every rank sends a different ``1/world`` of every tensor."""
    world = whole_number("world", world, 1)
    tensors = list(tensors)
    shards: list[Shard] = []
    buffers: list[BufferSpec] = []
    for t in tensors:
        part = -(-t.numel // world)
        strides = contiguous_strides(t.shape)
        for rank in range(world):
            lo, hi = min(rank * part, t.numel), min((rank + 1) * part, t.numel)
            if hi <= lo:
                continue
            for box in flat_range_boxes(t.shape, lo, hi):
                flat = sum(o * s for o, s in zip(box.offsets, strides))
                shards.append(Shard(t.name, box, rank, t.name, flat - lo, strides))
            buffers.append(BufferSpec(rank, t.name, t.dtype, hi - lo))
    return make_layout(tensors, shards, buffers)


def data_parallel(layout: Layout, replicas: int) -> Layout:
    """``replicas`` copies of ``layout``; copy ``k`` lives on ranks shifted by ``k * world_size``."""
    replicas = whole_number("replicas", replicas, 1)
    world = layout.world_size
    shards = [
        Shard(s.tensor, s.box, s.rank + k * world, s.buffer, s.offset, s.strides)
        for k in range(replicas)
        for s in layout.shards
    ]
    buffers = [BufferSpec(b.rank + k * world, b.name, b.dtype, b.numel) for k in range(replicas) for b in layout.buffers]
    return Layout(layout.tensors, tuple(shards), tuple(buffers))
