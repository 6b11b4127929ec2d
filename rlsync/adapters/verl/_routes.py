"""Rollout routing replay (verl's "R3") for verl's FSDP engine, where verl 0.9 implements it for its Megatron and
VeOmni engines only (installed through ``rlsync.patches.verl.apply_routing_replay``).

A verl user turns R3 on with verl's own options: ``actor_rollout_ref.rollout.enable_rollout_routing_replay=True``
(vLLM returns each sequence's routed experts, verl's agent loop puts them in the batch as ``routed_experts``, its
padding helpers carry them beside ``input_ids``) and ``actor_rollout_ref.actor.router_replay.mode=R3``. With an FSDP
actor, verl leaves both unused; with rlsync's plugin:

- ``ActorRolloutRefWorker.__init__``: an FSDP actor with ``router_replay.mode=R3`` marks the actor's batches for
  replay as verl does for Megatron (its ``enable_routing_replay`` flag, set on ``compute_log_prob`` and
  ``update_actor`` data, not the reference model's); another mode than R3 or disabled is refused by name.
- ``FSDPEngineWithLMHead.forward_step``: for a marked micro-batch, every MoE router of the model (transformers'
  ``*TopKRouter``) takes the batch's ``routed_experts`` (``rlsync.adapters.hf.replay_routes``), laid out as the
  engine lays out ``input_ids``: one packed row with ``use_remove_padding`` (plus its static pad, which routes
  itself), padded rows without. The replay stays open through the backward verl runs right after (a
  gradient-checkpointed layer routes again there) and ends with the next micro-batch or ``forward_backward_batch``.
  ``rlsync/routes_differing`` (share of replayed token-layers the actor would have routed elsewhere) goes into the
  micro-batch's metrics.

Ulysses sequence parallelism slices the packed row across ranks: refused with replay, by name.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rlsync import ConfigError
from rlsync.adapters.hf import HeldReplay

FSDP_STRATEGIES = ("fsdp", "fsdp2")


def wrap_worker_init(original: Any) -> Any:
    """``ActorRolloutRefWorker.__init__``: ``router_replay.mode=R3`` of an FSDP actor marks its batches for replay."""

    @functools.wraps(original)
    def __init__(self: Any, config: Any, role: str, *args: Any, **kwargs: Any) -> None:
        original(self, config, role, *args, **kwargs)
        from omegaconf import OmegaConf

        if OmegaConf.select(config, "actor.strategy") not in FSDP_STRATEGIES:
            return
        mode = OmegaConf.select(config, "actor.router_replay.mode", default="disabled")
        if mode == "R3":
            self.enable_routing_replay = True
        elif mode != "disabled":
            raise ConfigError(f"actor_rollout_ref.actor.router_replay.mode={mode} with an FSDP actor: rlsync replays "
                              f"rollout routes (R3) in verl's FSDP engine, not {mode}. Set router_replay.mode=R3 with "
                              "actor_rollout_ref.rollout.enable_rollout_routing_replay=True, or disabled")

    return __init__


def _routes(engine: Any, micro_batch: Any, routed: Any) -> torch.Tensor:
    """``routed_experts`` (a jagged nested tensor like ``input_ids``: ``[total, layers, top_k]`` values) as the
    forward's token layout: ``[1, total + static pad, layers, top_k]`` packed, ``[batch, longest, layers, top_k]`` padded (-1: no route)."""
    from verl.utils import tensordict_utils as tu

    values: torch.Tensor = routed.values().long()
    if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
        pad = engine._get_packed_pad_size(values.shape[0])
        return torch.cat([values, values.new_full((pad, *values.shape[1:]), -1)])[None]
    offsets = routed.offsets().tolist()
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    out = values.new_full((len(lengths), max(lengths), *values.shape[1:]), -1)
    for row, (start, length) in enumerate(zip(offsets, lengths)):
        out[row, :length] = values[start : start + length]
    return out


def held(engine: Any) -> HeldReplay:
    """The engine's replay held from a micro-batch's forward through its backward."""
    if getattr(engine, "_rlsync_replay", None) is None:
        engine._rlsync_replay = HeldReplay()
    replay: HeldReplay = engine._rlsync_replay
    return replay


def wrap_forward_step(original: Any) -> Any:
    """``FSDPEngineWithLMHead.forward_step``: a micro-batch marked for routing replay routes as its rollout did."""

    @functools.wraps(original)
    def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        from verl.utils import tensordict_utils as tu

        held(self).close()  # the previous micro-batch's backward is done
        if not tu.get_non_tensor_data(data=micro_batch, key="enable_routing_replay", default=False):
            return original(self, micro_batch, loss_function, forward_only)
        routed = micro_batch.get("routed_experts", None)
        if routed is None:
            raise ConfigError("actor_rollout_ref.actor.router_replay.mode=R3, but the batch has no routed_experts: set "
                              "actor_rollout_ref.rollout.enable_rollout_routing_replay=True (vLLM returns them)")
        if getattr(self, "use_ulysses_sp", False):
            raise ConfigError("rlsync's routing replay in verl's FSDP engine does not support Ulysses sequence "
                              "parallelism (the packed row is split across ranks): set ulysses_sequence_parallel_size=1 "
                              "or actor_rollout_ref.actor.router_replay.mode=disabled")
        log = held(self).open(self.module, _routes(self, micro_batch, routed))
        loss, output = original(self, micro_batch, loss_function, forward_only)
        output["metrics"]["rlsync/routes_differing"] = log.differing / max(log.replayed, 1)
        return loss, output

    return forward_step


def wrap_forward_backward_batch(original: Any) -> Any:
    """``FSDPEngine.forward_backward_batch``: the last micro-batch's replay ends with it (its backward is done)."""

    @functools.wraps(original)
    def forward_backward_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            held(self).close()

    return forward_backward_batch
