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


class _ServerAdapter:
    """FAKE of verl's vLLM ``ServerAdapter`` (``vllm_rollout/vllm_rollout.py``) as far as rlsync's engine route reads
    it before a sync: ``_has_server`` (rollout rank 0 of its replica), ``replica_rank``, ``_execute_method``."""

    def __init__(self, replica: int, leader: bool) -> None:
        self.replica_rank, self._has_server = replica, leader

    async def _execute_method(self, method: str, **kwargs: Any) -> None:
        raise AssertionError("no sync runs here")


def test_the_engine_route_gives_each_trainer_rank_its_own_credential_for_every_vllm_worker() -> None:
    """Two trainer ranks, two vLLM replicas of TP=2 (four rollout workers): each rank gets, per replica, one address a
    worker (consecutive ports, as vLLM's worker r binds P + r), each its own credential; each rollout worker the
    trainer's tensor list; a replica whose leader is missing is refused by name."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    import rlsync.adapters.verl  # noqa: F401
    from rlsync import ConfigError
    from rlsync.core import host_port, rank_address

    cls = CheckpointEngineRegistry.get("rlsync")
    tensors = [["w", "bfloat16", [4, 4]]]
    actors = [cls(bucket_size=1 << 20) for _ in range(2)]
    for engine in actors:
        engine.tensor_source = lambda: tensors
    config = RolloutConfig(name="vllm", tensor_model_parallel_size=2, checkpoint_engine=CheckpointEngineConfig(backend="rlsync"))
    rollouts = [cls(bucket_size=1 << 20) for _ in range(4)]
    for rank, engine in enumerate(rollouts):
        engine.attach_rollout(_ServerAdapter(rank // 2, rank % 2 == 0), config)
    metadata = [e.prepare() for e in (*actors, *rollouts)]
    actor_kwargs, rollout_kwargs = cls.build_topology(2, 4, metadata)
    assert actor_kwargs["engine"] == [True, True]
    leaders = [metadata[2]["engine"]["addresses"], metadata[4]["engine"]["addresses"]]
    for r in range(2):
        assert actor_kwargs["readers"][r] == [[rank_address(a, r) for a in group] for group in leaders]
    for group in leaders:
        (host, port), (_, next_port) = host_port(group[0]), host_port(group[1])
        assert next_port == port + 1 and host == "127.0.0.1"
    assert rollout_kwargs["engine_tensors"] == [tensors] * 4
    assert rollout_kwargs["readers"] == [[]] * 4  # no rollout worker binds a reader

    metadata[4] = rollouts[3].prepare()  # replica 1 seen through its second worker only
    with pytest.raises(ConfigError, match=r"rollout replicas \[1\] have no leader"):
        cls.build_topology(2, 4, metadata)
    without = [cls(bucket_size=1 << 20) for _ in range(2)]  # a trainer that cannot send its own shards
    for engine in without:
        engine.tensor_source = lambda: None
    _, worker_route = cls.build_topology(2, 4, [e.prepare() for e in (*without, *rollouts)])
    assert "engine_tensors" not in worker_route and all(worker_route["readers"])


def test_a_rollout_the_engine_route_cannot_take_is_named() -> None:
    from types import SimpleNamespace

    from rlsync.adapters.verl._engine_route import route_refusal

    adapter = _ServerAdapter(0, True)
    assert route_refusal(adapter, SimpleNamespace(name="vllm")) is None
    assert "'sglang'" in route_refusal(adapter, SimpleNamespace(name="sglang"))
    assert "_execute_method" in route_refusal(object(), SimpleNamespace(name="vllm"))
    assert "data_parallel_size=2" in route_refusal(adapter, SimpleNamespace(name="vllm", data_parallel_size=2))
    assert "disaggregation" in route_refusal(adapter, SimpleNamespace(name="vllm", disaggregation={"enabled": True}))
    other = {"vllm": {"weight_transfer_config": {"backend": "nccl"}}}
    assert "another backend" in route_refusal(adapter, SimpleNamespace(name="vllm", engine_kwargs=other))
