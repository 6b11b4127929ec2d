"""A trainer's layout read off real FSDP2 DTensors (issue #67): two ranks on a gloo mesh, ``fully_shard`` on the CPU,
each sending its own local shard in bf16 into a reader that holds the whole model. Judged by the bytes that land
(each rank's rows, equal to the gathered tensor's), the bytes that moved (each once, in bf16), and the collectives
the sync made (no all-gather: counted at ``torch.distributed``)."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # rows that do not split evenly in two (7, 5, 3), and a tensor of one row (the second rank holds nothing of it)
    return torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Embedding(5, 3), torch.nn.Linear(3, 1))


GATHERS = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "broadcast", "all_reduce")


def _rank(rank: int, port: int, hsdp: bool, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from rlsync import SyncOptions, WeightsReader, WeightsWriter
        from rlsync.layouts import from_dtensors, from_state_dict, writer_rank

        mesh = init_device_mesh("cpu", (2, 1) if hsdp else (2,), mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))
        model = fully_shard(_model(), mesh=mesh)
        named = dict(model.state_dict())
        assert all(isinstance(t, DTensor) for t in named.values())
        layout = from_dtensors(named, dtype="bfloat16")
        me = writer_rank(named, rank)
        mine = {s.tensor: s.box for s in layout.shards if s.rank == me}
        local = {name: t.to_local() for name, t in named.items()}
        # what this rank holds is exactly what the layout says it holds (uneven, or nothing)
        for name, t in named.items():
            if name in mine:
                assert tuple(local[name].shape) == mine[name].sizes, (name, local[name].shape, mine[name])
        reader, box = None, [None]
        if rank == 0:
            whole = from_state_dict({n: torch.empty(t.shape, dtype=torch.bfloat16) for n, t in named.items()})
            reader = WeightsReader(None, whole, 0, options=SyncOptions(timeout=30))
            box = [reader.address]
        dist.broadcast_object_list(box, src=0)
        counted: dict[str, int] = {}
        originals = {name: getattr(dist, name) for name in GATHERS}
        full_tensor = DTensor.full_tensor

        def counting(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                counted[name] = counted.get(name, 0) + 1
                return originals[name](*args, **kwargs)
            return call

        for name in GATHERS:
            setattr(dist, name, counting(name))
        DTensor.full_tensor = lambda self, **kw: (counted.__setitem__("full_tensor", counted.get("full_tensor", 0) + 1),
                                                  full_tensor(self, **kw))[1]
        try:  # the sync: each rank puts its local shard, cast to the engine's dtype; no collective
            sent = 0
            if mine:
                with WeightsWriter(layout, None, me, [box[0]], options=SyncOptions(timeout=30)) as writer:
                    writer.multi_put({name: local[name].to(torch.bfloat16).contiguous() for name in mine})
                    writer.complete(1)
                    sent = writer.last_bytes
        finally:
            for name in GATHERS:
                setattr(dist, name, originals[name])
            DTensor.full_tensor = full_tensor
        gathered = {name: t.full_tensor().to(torch.bfloat16) for name, t in named.items()}  # the check, after
        totals = [None, None]
        dist.all_gather_object(totals, sent)
        if rank == 0:
            assert reader is not None and reader.version == 1
            for name, tensor in gathered.items():
                assert bytes(reader.buffers()[name]) == tensor.view(torch.uint8).numpy().tobytes(), name
            reader.close()
            results.put({"counted": counted, "sent": totals, "mine": sorted(mine),
                         "bf16": sum(t.numel() * 2 for t in gathered.values())})
        else:
            results.put({"counted": counted, "mine": sorted(mine)})
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp2", "hsdp"])
def test_each_fsdp2_rank_sends_its_own_shard_in_bf16_and_nothing_is_gathered(hsdp: bool) -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    mp.start_processes(_rank, args=(_free_port(), hsdp, results), nprocs=2, join=True, start_method="spawn")
    got = [results.get(timeout=10) for _ in range(2)]
    first = next(g for g in got if "sent" in g)
    assert all(not g["counted"] for g in got), got  # no all-gather, broadcast or reduce during the sync
    assert sum(first["sent"]) == first["bf16"]  # every byte once, in bf16 (the fp32 trainer's half)
    if hsdp:  # replicas send once: the second holds a whole copy and sends nothing
        assert first["sent"][1] == 0 and sorted(len(g["mine"]) for g in got) == [0, 5]
    else:
        assert all(g["mine"] for g in got) and first["sent"][1] > 0
