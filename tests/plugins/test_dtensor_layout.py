"""A trainer's layout read off real FSDP2 DTensors (issue #67): two ranks on a gloo mesh, ``fully_shard`` on the CPU,
each sending its own local shard in bf16 into a reader that holds the whole model. Judged by the bytes that land
(each rank's rows, equal to the gathered tensor's), the bytes that moved (each once, in bf16), and the collectives
the sync made (no all-gather: counted at ``torch.distributed``)."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from _support.fsdp2_ranks import free_port, fsdp2_rank


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp"])
def test_each_fsdp2_rank_sends_its_own_shard_in_bf16_and_nothing_is_gathered(hsdp: bool) -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(fsdp2_rank, args=(free_port(), hsdp, results), nprocs=2, join=True, start_method="spawn")
    got = [results.get(timeout=10) for _ in range(2)]
    first = next(g for g in got if "sent" in g)
    assert all(not g["counted"] for g in got), got  # no all-gather, broadcast or reduce during the sync
    assert sum(first["sent"]) == first["bf16"]  # every byte once, in bf16 (the fp32 trainer's half)
    if hsdp:  # replicas send once: the second holds a whole copy and sends nothing
        assert first["sent"][1] == 0 and sorted(len(g["mine"]) for g in got) == [0, 5]
    else:
        assert all(g["mine"] for g in got) and first["sent"][1] > 0
