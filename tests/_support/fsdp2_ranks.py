"""Two FSDP2 ranks on a gloo mesh for tests/plugins/test_dtensor_layout.py (issue #67). Spawned children import the
rank function by its module's name, which must be on their path: tests/ is (pyproject's pythonpath), the test module
itself is not under pytest's importlib mode."""

from __future__ import annotations

import os
import socket
from typing import Any

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    # rows that do not split evenly in two (7, 5, 3), and a tensor of one row (the second rank holds nothing of it)
    return torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Embedding(5, 3), torch.nn.Linear(3, 1))


GATHERS = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_object", "broadcast", "all_reduce")


def fsdp2_rank(rank: int, port: int, hsdp: bool, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        from rlsync import SyncOptions, WeightsReader, WeightsWriter
        from rlsync.layouts import from_dtensors, from_state_dict, writer_rank

        mesh = init_device_mesh("cpu", (2, 1) if hsdp else (2,), mesh_dim_names=("replicate", "shard") if hsdp else ("shard",))
        model = fully_shard(small_model(), mesh=mesh)
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
