"""The backend's contract with verl, in one process (no Ray): prepare on every worker, build_topology in the
driver, init_process_group with each worker's part, send and receive concurrently. Here with a single rollout
worker, two trainer ranks whose tensors are split unevenly, and a tensor of one row."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("verl")
torch = pytest.importorskip("torch")

pytestmark = pytest.mark.filterwarnings("ignore")


def test_two_trainer_ranks_into_one_rollout_worker() -> None:
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import rlsync.adapters.verl  # noqa: F401  (registers the backend, as the entry point does)

    cls = CheckpointEngineRegistry.get("rlsync")
    actors = [cls(bucket_size=1 << 20, is_master=r == 0) for r in range(2)]
    rollout = cls(bucket_size=1 << 20, timeout=30)
    metadata = [e.prepare() for e in (*actors, rollout)]
    actor_kwargs, rollout_kwargs = cls.build_topology(2, 1, metadata)
    assert all(len(v) == 2 for v in actor_kwargs.values()) and all(len(v) == 1 for v in rollout_kwargs.values())
    for rank, engine in enumerate(actors):
        engine.init_process_group(**{k: v[rank] for k, v in actor_kwargs.items()})
    rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})

    gen = torch.Generator().manual_seed(0)
    weights = {"embed.weight": torch.randn(7, 5, generator=gen).to(torch.bfloat16),  # 7 rows: 4 + 3
               "norm.weight": torch.randn(5, generator=gen),
               "bias.one_row": torch.randn(1, 5, generator=gen).to(torch.bfloat16)}  # rank 1 holds none of it

    async def sync(steps: Any) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
        received: dict[str, torch.Tensor] = {}

        async def consume() -> None:
            async for name, tensor in rollout.receive_weights(global_steps=steps):
                received[name] = tensor.clone()

        results = await asyncio.gather(*(e.send_weights(iter(weights.items()), global_steps=steps) for e in actors),
                                       consume())
        return list(results[:2]), received

    for steps in (1, None, 2):
        metrics, received = asyncio.run(sync(steps))
        assert received.keys() == weights.keys()
        assert all(torch.equal(received[n], t) for n, t in weights.items())
        assert {m["rlsync/version"] for m in metrics} == {-1 if steps is None else steps}
        total = sum(t.numel() * t.element_size() for t in weights.values())
        assert metrics[0]["rlsync/bytes"] == total and metrics[0]["rlsync/senders"] == 2
        for name in weights:
            weights[name] = weights[name] + 1
    for engine in (*actors, rollout):
        engine.finalize()
