"""Property tests: for random layouts, executing the plan fills every destination byte exactly
once, with the right global element, sending nothing twice and never leaving a buffer."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlsync import Box, Layout, Shard, TensorMeta, build_plan, make_layout
from rlsync.layouts import (
    allocate,
    contiguous_strides,
    copy_transfers,
    data_parallel,
    fsdp,
    gather_shards,
    raw_dtype,
    scatter,
    zero3,
)

DTYPES = ("float32", "bfloat16", "int8")


@st.composite
def tensor_lists(draw: st.DrawFn) -> list[TensorMeta]:
    n = draw(st.integers(1, 3))
    return [
        TensorMeta(f"t{i}", draw(st.sampled_from(DTYPES)), tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3))))
        for i in range(n)
    ]


@st.composite
def grid_layouts(draw: st.DrawFn, tensors: list[TensorMeta]) -> Layout:
    """Each tensor cut into a random grid (uneven cuts along up to two dims), boxes spread over
    random ranks, packed back to back into one buffer per rank and dtype; then replicated."""
    world = draw(st.integers(1, 4))
    shards: list[Shard] = []
    used: dict[tuple[int, str], int] = {}
    for t in tensors:
        cuts = []
        for d in t.shape:
            k = draw(st.integers(0, min(2, d - 1)))
            points = sorted(draw(st.sets(st.integers(1, d - 1), min_size=k, max_size=k))) if k else []
            edges = [0, *points, d]
            cuts.append(list(zip(edges[:-1], edges[1:])))
        boxes = [()]
        for dim_cuts in cuts:
            boxes = [b + (c,) for b in boxes for c in dim_cuts]
        for cell in boxes:
            box = Box(tuple(lo for lo, _ in cell), tuple(hi - lo for lo, hi in cell))
            rank = draw(st.integers(0, world - 1))
            key = (rank, t.dtype)
            at = used.get(key, 0)
            gap = draw(st.integers(0, 3))  # buffers may hold padding between shards
            shards.append(Shard(t.name, box, rank, f"flat.{t.dtype}", at + gap, contiguous_strides(box.sizes)))
            used[key] = at + gap + box.numel
    layout = make_layout(tensors, shards)
    return data_parallel(layout, draw(st.integers(1, 3)))


@st.composite
def layouts(draw: st.DrawFn, tensors: list[TensorMeta]) -> Layout:
    kind = draw(st.sampled_from(("grid", "grid", "fsdp", "zero3")))
    if kind == "fsdp":
        return data_parallel(fsdp(tensors, draw(st.integers(1, 5))), draw(st.integers(1, 2)))
    if kind == "zero3":
        return zero3(tensors, draw(st.integers(1, 5)))
    return draw(grid_layouts(tensors))


def _run(src: Layout, dst: Layout) -> None:
    rng = np.random.default_rng(0)
    metas = src.tensor_map()
    values = {
        name: rng.integers(0, np.iinfo(raw_dtype(m.dtype)).max, size=m.shape, dtype=raw_dtype(m.dtype), endpoint=True)
        for name, m in metas.items()
    }
    src_bufs = {r: allocate(src, r) for r in range(src.world_size)}
    for r in src_bufs:
        scatter(src, r, values, src_bufs[r])
    dst_bufs = {r: allocate(dst, r) for r in range(dst.world_size)}
    writes = {r: {k: np.zeros(v.nbytes, np.int32) for k, v in bufs.items()} for r, bufs in dst_bufs.items()}

    plan = build_plan(src, dst)
    assert plan.stats.bytes_sent == plan.stats.bytes_needed
    assert plan.stats.redundancy == 1.0
    for t in plan.transfers:
        copy_transfers([t], src_bufs[t.src_rank], dst_bufs[t.dst_rank])
        for _, d_off, n in t.runs():
            writes[t.dst_rank][t.dst_buffer][d_off : d_off + n] += 1

    covered = {r: {k: np.zeros(v.nbytes, np.int32) for k, v in bufs.items()} for r, bufs in dst_bufs.items()}
    for r in dst_bufs:
        for shard, view in gather_shards(dst, r, dst_bufs[r]):
            region = tuple(slice(o, o + n) for o, n in zip(shard.box.offsets, shard.box.sizes))
            np.testing.assert_array_equal(view, values[shard.tensor][region], err_msg=f"{shard}")
            size = view.itemsize
            for s_idx in np.ndindex(*shard.box.sizes):
                at = (shard.offset + sum(i * s for i, s in zip(s_idx, shard.strides))) * size
                covered[r][shard.buffer][at : at + size] += 1
    for r in dst_bufs:
        for name in dst_bufs[r]:
            # every byte a destination shard owns is written exactly once; no other byte is touched
            np.testing.assert_array_equal(writes[r][name], covered[r][name], err_msg=f"rank {r} buffer {name}")
            assert covered[r][name].max(initial=0) <= 1


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_layouts_plan_completely_once_and_in_bounds(data: st.DataObject) -> None:
    tensors = data.draw(tensor_lists())
    _run(data.draw(layouts(tensors)), data.draw(layouts(tensors)))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_per_rank_parts_add_up_to_the_whole_plan(data: st.DataObject) -> None:
    tensors = data.draw(tensor_lists())
    src, dst = data.draw(layouts(tensors)), data.draw(layouts(tensors))
    whole = build_plan(src, dst)
    for r in range(dst.world_size):
        part = build_plan(src, dst, dst_ranks=[r])
        assert sorted(part.transfers, key=repr) == sorted(whole.for_dst_rank(r), key=repr)
