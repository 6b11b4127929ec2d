"""verl's Megatron engine on rlsync's shard route (issue #68), on verl's checkpoint-engine contract in processes of
their own (no Ray: verl's manager drives the same calls, ``test_verl_backend.py`` runs them through it): two trainer
ranks of a real megatron-core model at tensor parallelism 2 (``_support/megatron_ranks.py``, where the stand-in for
verl's ``MegatronEngine`` is named), one rollout worker. Each rank sends its own parameters as megatron-core holds
them (no Megatron-Bridge export, no gather), in bf16, each byte once; the rollout worker's tensors, the checkpoint's,
compute megatron's own logits to bf16 tolerance."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

from _support import megatron_ranks as mr  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
PROMPT = [5, 17, 42, 99, 3, 250]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_verls_megatron_engine_sends_each_ranks_own_parameters_and_the_rollout_holds_the_checkpoint() -> None:
    import torch.multiprocessing as mp
    from transformers import LlamaForCausalLM
    from verl.checkpoint_engine import CheckpointEngineRegistry

    import rlsync.adapters.verl  # noqa: F401

    cls = CheckpointEngineRegistry.get("rlsync")
    rollout = cls(bucket_size=1 << 20, timeout=120)
    context = mp.get_context("spawn")
    to_driver, results = context.Queue(), context.Queue()
    from_driver = [context.Queue() for _ in range(2)]
    ranks = mp.start_processes(mr.verl_rank_main, args=(2, _free_port(), 2, 1, to_driver, from_driver, results, 2, PROMPT),
                               nprocs=2, join=False, start_method="spawn")
    received: dict[str, torch.Tensor] = {}
    try:
        metadata = dict(to_driver.get(timeout=300) for _ in range(2))
        actor_kwargs, rollout_kwargs = cls.build_topology(2, 1, [metadata[0], metadata[1], rollout.prepare()])
        assert "tensors" in metadata[0]  # the shard route's tensor list, from trainer rank 0
        for rank in range(2):
            from_driver[rank].put({k: v[rank] for k, v in actor_kwargs.items()})
        rollout.init_process_group(**{k: v[0] for k, v in rollout_kwargs.items()})

        async def receive() -> None:
            async for name, tensor in rollout.receive_weights(global_steps=None):
                received[name] = tensor.clone()

        for _ in range(2):
            asyncio.run(receive())
        reports = sorted((results.get(timeout=120) for _ in range(2)), key=lambda r: r["rank"])
        while not ranks.join():
            pass
    finally:
        rollout._close_rollout()
    hf = LlamaForCausalLM(mr.hf_config()).float().eval()
    assert {n: t.dtype for n, t in received.items()} == {n: torch.bfloat16 for n in hf.state_dict()}
    hf.load_state_dict({n: t.float() for n, t in received.items()})
    with torch.no_grad():
        ours = hf(torch.tensor([PROMPT])).logits[0]
    theirs = torch.from_numpy(reports[0]["logits"])[:, : mr.VOCAB]
    assert (ours - theirs).abs().max() < 0.05, (ours - theirs).abs().max()  # bf16 weights against fp32
    model_bytes = sum(t.numel() * 2 for t in received.values())
    for step in range(2):
        metrics = [r["metrics"][step] for r in reports]
        assert all(m["rlsync/gathered"] == 0 for m in metrics)
        assert sum(m["rlsync/rank_wire_bytes"] for m in metrics) == model_bytes  # each byte once, padding never
        assert all(m["rlsync/rank_wire_bytes"] == m["rlsync/rank_plan_bytes"] for m in metrics)
