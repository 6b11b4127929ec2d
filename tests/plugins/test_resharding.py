"""Two FSDP trainer ranks to two engine ranks with vLLM's fused, tensor-parallel parameters."""

from __future__ import annotations

from typing import Any

import pytest

from rlsync.core._weights import WeightsReader

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("landing", ["direct", "staged"])
def test_fsdp2_to_tp2_lands_each_ranks_slices_in_fused_buffers(sync: Any, landing: str) -> None:
    src, dst = sync.layouts("fsdp2_tp2")
    readers = [WeightsReader(src, dst, r, transport="shm", landing=landing) for r in (0, 1)]
    try:
        addresses = {r.rank: r.address for r in readers}
        writers = [sync.writer("fsdp2_tp2", "shm", addresses, [1, 2], rank=w, wait=False) for w in (0, 1)]
        for w in writers:
            out, err = w.communicate(timeout=120)
            assert w.returncode == 0, err
        for reader in readers:
            assert reader.version == 2
            sync.assert_landed("fsdp2_tp2", reader, 2)
        # Each engine rank received only its own slices: the plan for it moves exactly its buffers' bytes.
        for reader in readers:
            own = sum(b.numel * 2 for b in dst.buffers if b.rank == reader.rank)
            assert reader.plan.stats.bytes_needed == own
            assert reader.plan.stats.redundancy == 1.0
    finally:
        for reader in readers:
            reader.close()


def test_boxes_land_in_place_inside_full_tensor_buffers_and_nothing_else_is_sent(sync: Any) -> None:
    """The vLLM adapter's layout: each engine rank holds whole-tensor-shaped staging buffers and receives
    only the box its loader reads (row or strided column halves), every byte once."""
    import numpy as np

    from rlsync.core._views import gather_shards

    src, dst = sync.layouts("boxes_tp2")
    readers = [WeightsReader(src, dst, r, transport="shm", landing="staged") for r in (0, 1)]
    try:
        w = sync.writer("boxes_tp2", "shm", {r.rank: r.address for r in readers}, [1], wait=False)
        _, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
        expected = sync.values(dst, 1)
        for reader in readers:
            assert reader.version == 1
            sync.assert_landed("boxes_tp2", reader, 1)
            buffers = reader.buffers()
            for shard, _ in gather_shards(dst, reader.rank, buffers):
                full = buffers[shard.tensor].view(expected[shard.tensor].dtype).reshape(expected[shard.tensor].shape)
                outside = np.ones(full.shape, bool)
                outside[tuple(slice(o, o + n) for o, n in zip(shard.box.offsets, shard.box.sizes))] = False
                assert not full[outside].any(), f"{shard.tensor}: bytes outside rank {reader.rank}'s box"
            assert "layer5.weight" not in {s.tensor for s in dst.shards if s.rank == 0}
            assert reader.plan.stats.bytes_needed == sum(
                s.box.numel * (2 if s.tensor != "norm.weight" else 4) for s in dst.shards if s.rank == reader.rank)
    finally:
        for reader in readers:
            reader.close()
