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
