"""verl's rollout routing replay (R3) with an FSDP actor, which verl 0.9 implements for Megatron and VeOmni only:
with rlsync's plugin, ``actor_rollout_ref.actor.router_replay.mode=R3`` marks the actor's batches and verl's own
``FSDPEngineWithLMHead.forward_step`` routes every token of a batch carrying ``routed_experts`` (laid out by verl's own
``left_right_2_no_padding``) to those experts, packed (``use_remove_padding``) and padded.

The engine object is verl's class without its ``__init__`` (which builds the FSDP wrapping over a device mesh): it
holds a plain transformers Qwen3-MoE, the attributes ``forward_step`` reads set as ``FSDPEngine.__init__`` sets them.
The recorded routes stand for vLLM's ``routed_experts`` (its Model Runner V2 returns them on a GPU): the experts the
sampling weights' own routers pick, in transformers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/, for _support

from _support import model_trainer as models  # noqa: E402
from _support.moe_routes import own_routes  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
LAYERS, TOP_K = 2, 2


def _engine(model: torch.nn.Module) -> Any:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    import rlsync.adapters.verl  # noqa: F401  (verl's plugin entry: registers the backend, applies the patches)

    engine = FSDPEngineWithLMHead.__new__(FSDPEngineWithLMHead)
    engine.module, engine.pad_to_length, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = model, False, False, 1
    engine._autocast_dtype = torch.float32
    engine.get_data_parallel_group = lambda: None
    return engine


def _batch(sequences: list[list[int]], prompt_len: list[int], routes: list[np.ndarray], packed: bool) -> Any:
    """The actor's batch as verl's trainer hands it over: prompts left-padded, responses right-padded, and
    ``routed_experts`` ``[batch, seq, layers, top_k]`` (zeros where nothing was recorded), through verl's own
    ``left_right_2_no_padding``."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    p, r = max(prompt_len), max(len(s) - n for s, n in zip(sequences, prompt_len))
    ids = torch.zeros(len(sequences), p + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    experts = torch.zeros(*ids.shape, LAYERS, TOP_K, dtype=torch.long)
    for i, (seq, n, record) in enumerate(zip(sequences, prompt_len, routes)):
        start = p - n
        ids[i, start : start + len(seq)] = torch.tensor(seq)
        mask[i, start : start + len(seq)] = 1
        experts[i, start : start + len(seq)] = torch.from_numpy(record)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    data = TensorDict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids,
                       "response_mask": mask[:, p:], "routed_experts": experts}, batch_size=[len(sequences)])
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, use_remove_padding=packed, temperature=1.0, enable_routing_replay=True)
    return data


@pytest.mark.parametrize("packed", [True, False])
def test_an_fsdp_actor_replays_the_rollouts_routes_in_verls_own_forward_step(packed: bool,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from rlsync.adapters.verl._routes import wrap_forward_backward_batch

    # verl 0.9 registers no CPU platform (verl.plugin.platform: cuda, npu, rocm): the engine's device lookups say CPU
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")

    sampler = models.build("qwen3-moe", 100)  # the weights that sampled
    actor = models.build("qwen3-moe", 100)
    with torch.no_grad():  # the actor, a step later
        for param in actor.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    rng = np.random.default_rng(0)
    prompt_len = [5, 3, 4]
    sequences = [rng.integers(1, 256, n + extra).tolist() for n, extra in zip(prompt_len, (9, 12, 6))]
    routes = [own_routes(sampler, torch.tensor([s]), LAYERS, TOP_K)[0] for s in sequences]
    engine = _engine(actor)
    given: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, args, out: given.append(args[1].detach().clone()))
             for m in actor.modules() if type(m).__name__.endswith("Experts")]

    def tokens_per_row(layer: torch.Tensor) -> list[torch.Tensor]:
        if packed:
            return list(layer.split([len(s) for s in sequences]))
        return [layer.view(len(sequences), -1, TOP_K)[i, : len(s)] for i, s in enumerate(sequences)]

    def loss(model_output: dict[str, Any], data: Any, dp_group: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        return -model_output["log_probs"].values().sum(), {}

    # the actor's update: verl's forward_step, then the backward verl runs after it, while the replay is still open
    loss_value, output = engine.forward_step(_batch(sequences, prompt_len, routes, packed), loss, forward_only=False)
    loss_value.backward()
    assert engine._rlsync_replay.is_open  # open through the backward (a checkpointed layer routes again there)
    assert getattr(FSDPEngine.forward_backward_batch, "_rlsync_routes", False)  # verl's, wrapped by the plugin entry
    wrap_forward_backward_batch(lambda engine: None)(engine)  # that wrapper closes what the last micro-batch opened
    assert not engine._rlsync_replay.is_open
    for layer in range(LAYERS):
        for row, record in zip(tokens_per_row(given[layer]), routes):
            assert torch.equal(row, torch.from_numpy(record[:, layer]).long()), (packed, layer)
    assert 0 < output["metrics"]["rlsync/routes_differing"] < 1  # the moved actor alone would route some elsewhere
    assert all(p.grad is not None for n, p in actor.named_parameters() if "gate" in n)  # routers still learn

    # the same batch unmarked (verl's flag off): the actor routes itself, and some tokens go elsewhere
    given.clear()
    unmarked = _batch(sequences, prompt_len, routes, packed)
    tu.assign_non_tensor(unmarked, enable_routing_replay=False)
    engine.forward_step(unmarked, None, forward_only=True)
    differ = sum(int((row.sort(-1).values != torch.from_numpy(record[:, layer]).long().sort(-1).values).any(-1).sum())
                 for layer in range(LAYERS) for row, record in zip(tokens_per_row(given[layer]), routes))
    assert differ > 0
    for hook in hooks:
        hook.remove()


def test_router_replay_r3_marks_an_fsdp_actors_batches_and_other_modes_are_refused() -> None:
    from omegaconf import OmegaConf

    from rlsync import ConfigError
    from rlsync.adapters.verl._routes import wrap_worker_init

    def config(strategy: str, mode: str) -> Any:
        return OmegaConf.create({"actor": {"strategy": strategy, "router_replay": {"mode": mode}}})

    def worker(cfg: Any) -> Any:  # what verl's __init__ leaves for an FSDP actor: no routing replay
        class Worker:
            def __init__(self, config: Any, role: str) -> None:
                self.enable_routing_replay = False

        Worker.__init__ = wrap_worker_init(Worker.__init__)  # type: ignore[method-assign]
        return Worker(cfg, "actor_rollout")

    assert worker(config("fsdp2", "R3")).enable_routing_replay
    assert not worker(config("fsdp", "disabled")).enable_routing_replay
    assert not worker(config("megatron", "R3")).enable_routing_replay  # verl's own, untouched
    with pytest.raises(ConfigError, match="router_replay.mode=R2 with an FSDP actor"):
        worker(config("fsdp", "R2"))


def test_a_marked_batch_without_routes_or_under_ulysses_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers.engine.fsdp import transformer_impl

    from rlsync import ConfigError

    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    engine = _engine(models.build("qwen3-moe", 100))
    sequences, prompt_len = [[5, 17, 42, 99, 3, 8]], [3]
    routes = [np.zeros((6, LAYERS, TOP_K), dtype=np.int64)]
    batch = _batch(sequences, prompt_len, routes, packed=True)
    del batch["routed_experts"]
    with pytest.raises(ConfigError, match="enable_rollout_routing_replay=True"):
        engine.forward_step(batch, None, forward_only=True)
    engine.use_ulysses_sp = True
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=1"):
        engine.forward_step(_batch(sequences, prompt_len, routes, packed=True), None, forward_only=True)
