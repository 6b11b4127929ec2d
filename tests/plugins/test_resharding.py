"""Two FSDP trainer ranks to two engine ranks with vLLM's fused, tensor-parallel parameters."""

from __future__ import annotations

from typing import Any

import pytest

from rlsync import SyncOptions, WeightsReader

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("landing,checksum", [("direct", False), ("staged", False), ("direct", True)])
def test_fsdp2_to_tp2_lands_each_ranks_slices_in_fused_buffers(sync: Any, landing: str, checksum: bool) -> None:
    """With checksums too: a trainer buffer reaches a reader in several separate runs (fused q/k/v pieces)."""
    src, dst = sync.layouts("fsdp2_tp2")
    readers = [WeightsReader(src, dst, r, landing=landing, options=SyncOptions(transport="shm", verify=checksum)) for r in (0, 1)]
    try:
        addresses = {r.rank: r.address for r in readers}
        extra = ("--checksum",) if checksum else ()
        writers = [sync.writer("fsdp2_tp2", "shm", addresses, [1, 2], rank=w, wait=False, extra=extra) for w in (0, 1)]
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


def test_vllm_workers_get_only_their_boxes_and_the_loader_sees_whole_tensors(sync: Any) -> None:
    """The vLLM adapter's staging: each worker receives only the box its loader reads, stored compactly,
    and hands the loader a whole-tensor-shaped view in which the box holds the trainer's values."""
    import numpy as np
    import torch

    from rlsync import StagedReceiver
    from rlsync.layouts import SLACK

    _, dst = sync.layouts("boxes_tp2")
    tensors = [[t.name, t.dtype, t.shape] for t in dst.tensors]
    boxes = sync.boxes_tp2
    receivers = [StagedReceiver(tensors, boxes=boxes, rank=r) for r in (0, 1)]
    try:
        w = sync.writer("boxes_tp2", "shm", {r: rec.address for r, rec in enumerate(receivers)}, [1], wait=False)
        expected = sync.values(dst, 1)
        for rank, receiver in enumerate(receivers):
            version, views, finish = receiver.next(timeout=60)
            assert version == 1
            seen = {}
            for name, view in views:
                (o, n) = boxes[rank][name]
                assert tuple(view.shape) == tuple(next(t[2] for t in tensors if t[0] == name))
                region = tuple(slice(a, a + b) for a, b in zip(o, n))
                got = view[region].contiguous().view({2: torch.int16, 4: torch.int32}[view.element_size()]).numpy()
                np.testing.assert_array_equal(got.view(expected[name].dtype), expected[name][region], err_msg=name)
                seen[name] = view
            finish(None)
            assert set(seen) == set(boxes[rank])  # layer5 reaches rank 1 only
            buffers = receiver.reader.buffers()
            assert not buffers[SLACK[0]].any() and not buffers[SLACK[1]].any()  # nothing landed outside the boxes
            own = sum(s.box.numel * (4 if s.tensor == "norm.weight" else 2) for s in dst.shards if s.rank == rank)
            assert receiver.reader.plan.stats.bytes_needed == own
        _, err = w.communicate(timeout=120)
        assert w.returncode == 0, err
    finally:
        for receiver in receivers:
            receiver.close()
