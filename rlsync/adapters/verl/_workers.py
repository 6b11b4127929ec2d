"""What rlsync's patches of verl (``rlsync.patches.verl``) make verl's workers and manager do with the ``rlsync``
backend: hand it an unmerged LoRA adapter, and check the trainer's canary on every rollout replica.

**LoRA.** Trainer worker (``ActorRolloutRefWorker.update_weights``): verl asks its model engine for
``get_per_tensor_param()`` with the defaults, which for an unmerged adapter is the base model alone. Here it asks with
``base_sync_done=True``, as verl's own colocated sync does once the rollout holds the base: the adapter's A/B
matrices and its PEFT configuration, which go to ``RlsyncCheckpointEngine.send_weights`` (for a model without an
unmerged adapter the same call yields what the defaults yield). Rollout worker
(``CheckpointEngineWorker.update_weights``): the version's configuration, if it came with one, goes to verl's server
adapter as ``peft_config`` with ``base_sync_done=True``; verl's vLLM adapter then replaces its LoRA adapter with the
new one (``update_weights_from_ipc``) and its server generates with it.

**Canary** (``rlsync.Canary``; ``engine_kwargs.rlsync.canary=false`` turns it off). Every trainer rank computes the
actor's log-probs of the canary batch with the weights it is about to send (under FSDP that forward is collective,
inside the engine's ``eval_mode``, which loads offloaded parameters) and the version carries it. verl pauses its
engines for the whole sync and resumes them in the same manager call (``abort_all_requests`` to
``resume_generation``): no forward can run on a rollout engine before that. So the check runs right after verl's
``CheckpointEngineManager.update_weights`` resumed them, before it returns to the trainer: every replica's server
computes the canary's prompt log-probs (its ``generate`` with ``prompt_logprobs``; with its LoRA adapter, if it serves
one), the largest mean deviation becomes the step's ``rlsync/canary_deviation``, and one above the tolerance raises
``CanaryError`` naming it and where. In verl's synchronous trainers nothing generates in between (the trainer is the
only client and waits in ``update_weights``), so a refused version never produces a sample; in the fully async
trainers, requests queued during the sync may start on it before the verdict. verl's vLLM path keeps no previous
version to return to: a refused version stops the run. Model engines other than a transformers module (Megatron's
chunks) are not checked (said once).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from typing import Any

import torch

from rlsync import Canary, ConfigError
from rlsync.adapters.verl._engine import CANARY_METRIC, RlsyncCheckpointEngine, timeline_option
from rlsync.adapters.verl._engine_route import WEIGHT_TRANSFER_CONFIG
from rlsync.adapters.verl._shards import trainer_shards
from rlsync.core import span
from rlsync.patches.verl import apply_timeline

_log = logging.getLogger("rlsync")


def actor_update_weights(original: Any) -> Any:
    @functools.wraps(original)
    async def update_weights(self: Any, global_steps: int | None = None, mode: str = "auto") -> Any:
        backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        engine = getattr(self, "checkpoint_engine", None)
        if backend == "naive" or not isinstance(engine, RlsyncCheckpointEngine):
            return await original(self, global_steps=global_steps, mode=mode)
        canary = trainer_canary(self.actor.engine) if engine.options.canary else None
        shards = trainer_shards(self.actor.engine, str(getattr(self.config.rollout, "dtype", "bfloat16")))
        if shards is not None:  # each rank's own local shards, straight: nothing gathered
            return await engine.send_shards(shards, global_steps=global_steps, canary=canary) or {}
        params, peft_config = self.actor.engine.get_per_tensor_param(layered_summon=self.layered_summon,
                                                                     base_sync_done=True)
        if peft_config is not None and not getattr(self, "base_sync_done", True):
            raise ConfigError("the rollout starts from dummy weights (actor_rollout_ref.rollout.load_format=dummy) and "
                              "the LoRA adapter is not merged: rlsync sends the adapter alone, so the rollout must load "
                              "the base model itself. Set rollout.load_format=auto, or lora.merge=True")
        return await engine.send_weights(params, global_steps=global_steps, peft_config=peft_config, canary=canary) or {}

    return update_weights


def actor_execute_checkpoint_engine(original: Any) -> Any:
    """``ActorRolloutRefWorker.execute_checkpoint_engine``: the backend learns what its trainer sends on the shard route
    (``RlsyncCheckpointEngine.tensor_source``), which the rollout engines' init needs (``_engine_route``)."""

    @functools.wraps(original)
    def execute_checkpoint_engine(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        engine = getattr(self, "checkpoint_engine", None)
        actor = getattr(self, "actor", None)
        if isinstance(engine, RlsyncCheckpointEngine) and engine.tensor_source is None and actor is not None:
            dtype = str(getattr(self.config.rollout, "dtype", "bfloat16"))
            engine.tensor_source = functools.partial(shard_tensor_list, actor.engine, dtype)
        return original(self, method, *args, **kwargs)

    return execute_checkpoint_engine


def shard_tensor_list(model_engine: Any, rollout_dtype: str) -> list[list[Any]] | None:
    """``[[name, dtype, full shape], ...]`` of what ``trainer_shards`` sends, on trainer rank 0 (the others: None, as
    where the shard route does not apply)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    shards = trainer_shards(model_engine, rollout_dtype)
    if shards is None:
        return None
    return [[t.name, t.dtype, [int(n) for n in t.shape]] for t in shards.layout.tensors]


def trainer_canary(model_engine: Any) -> Canary | None:
    """The canary of the model engine's module (every rank: an FSDP forward is collective), or None where it holds no
    transformers module."""
    module = getattr(model_engine, "module", None)
    if not isinstance(module, torch.nn.Module):
        _say_unchecked(f"verl's {type(model_engine).__name__} holds no single transformers module")
        return None
    with model_engine.eval_mode():  # verl's own: offloaded parameters come back for the forward
        return Canary.of(module)


@functools.cache
def _say_unchecked(why: str) -> None:
    _log.warning("rlsync: the canary is not checked in this run: %s", why)


def rollout_init(original: Any) -> Any:
    """``CheckpointEngineWorker.__init__``: the backend learns the worker's server adapter and rollout config (whether
    its vLLM engine takes its own slice: ``_engine_route``)."""

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if isinstance(self.checkpoint_engine, RlsyncCheckpointEngine):
            self.checkpoint_engine.attach_rollout(self.server_adapter, self.rollout_config)

    return __init__


def rollout_config_init(original: Any) -> Any:
    """``RolloutConfig.__post_init__``: a vLLM rollout with the ``rlsync`` checkpoint backend runs rlsync's weight-transfer
    backend in its engine (``engine_kwargs.vllm.weight_transfer_config``, unless the user set one), which verl's vLLM
    server puts on vLLM's command line; the one flag stays the user's only one."""

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        original(self)
        checkpoint = getattr(self, "checkpoint_engine", None)
        backend = checkpoint.get("backend") if isinstance(checkpoint, dict) else getattr(checkpoint, "backend", None)
        if self.name != "vllm" or backend != "rlsync":
            return
        engine_kwargs = dict(self.engine_kwargs or {})
        vllm = dict(engine_kwargs.get("vllm") or {})
        if vllm.get("weight_transfer_config") is None:
            vllm["weight_transfer_config"] = dict(WEIGHT_TRANSFER_CONFIG)
            engine_kwargs["vllm"] = vllm
            self.engine_kwargs = engine_kwargs

    return __post_init__


def rollout_update_weights(original: Any) -> Any:
    @functools.wraps(original)
    async def update_weights(self: Any, global_steps: int | None = None) -> None:
        engine = self.checkpoint_engine
        if not isinstance(engine, RlsyncCheckpointEngine):
            return await original(self, global_steps=global_steps)  # type: ignore[no-any-return]
        if engine.engine_route:  # the vLLM workers receive their slices; the replica's leader drives the version
            await engine.drive_engine(global_steps)
            return None
        peft_config = await engine.landed_adapter_config()
        adapter = {} if peft_config is None else {"peft_config": peft_config, "base_sync_done": True}
        await self.server_adapter.update_weights(engine.receive_weights(global_steps=global_steps),
                                                 global_steps=global_steps, wire_format="named_tensors", **adapter)
        return None

    return update_weights


def manager_update_weights(original: Any) -> Any:
    """``CheckpointEngineManager.update_weights`` (verl's ``auto_await`` wrapper around the coroutine function)."""
    from verl.utils.ray_utils import auto_await

    inner = original.__wrapped__

    @auto_await  # type: ignore[untyped-decorator]
    @functools.wraps(inner)
    async def update_weights(self: Any, global_steps: int | None = None) -> Any:
        # the timeline: the driver's view of a sync, from pausing the rollout to resuming it (what generation waits for)
        if self.backend == "rlsync":
            options = self.config.engine_kwargs.get("rlsync")
            timeline_option(options)
            if (options or {}).get("timeline") and not apply_timeline(update_actor=trainer_update_actor,
                                                                       generate_sequences=manager_generate_sequences):
                _say_driver_untimed()
        with span("sync", route="verl", step=global_steps) as timeline:
            metrics = await inner(self, global_steps=global_steps)
            if isinstance(metrics, dict):
                timeline.update(version=metrics.get("rlsync/sync_version"), bytes=metrics.get("rlsync/bytes"))
        canary = metrics.pop(CANARY_METRIC, None) if isinstance(metrics, dict) else None
        deviation = None if canary is None else await check_canary(self.replicas, Canary(**canary))
        if deviation is not None:
            metrics["rlsync/canary_deviation"] = deviation
        return metrics

    return update_weights


@functools.cache
def _say_driver_untimed() -> None:
    _log.warning("rlsync: the timeline records verl's syncs but not its train steps and generations: its driver is not "
                 "verl 0.9's RayPPOTrainer with an AgentLoopManager (rlsync times those two)")


def trainer_update_actor(original: Any) -> Any:
    """``RayPPOTrainer._update_actor`` (verl's driver): the step's training, a ``train`` span of the timeline (recorded
    where ``engine_kwargs.rlsync.timeline`` turned it on; nothing otherwise)."""

    @functools.wraps(original)
    def _update_actor(self: Any, batch: Any) -> Any:
        with span("train", step=getattr(self, "global_steps", None), samples=len(batch)):
            return original(self, batch)

    return _update_actor


def manager_generate_sequences(original: Any) -> Any:
    """``AgentLoopManager.generate_sequences`` (verl's driver; its ``auto_await`` around the coroutine function): the
    batch's generation, a ``request`` span of the timeline with its sequences and the response tokens they made."""
    from verl.utils.ray_utils import auto_await

    inner = original.__wrapped__

    @auto_await  # type: ignore[untyped-decorator]
    @functools.wraps(inner)
    async def generate_sequences(self: Any, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        with span("request", sequences=len(prompts), engine="verl") as request:
            output = await inner(self, prompts, *args, **kwargs)
            batch = getattr(output, "batch", None)
            if batch is not None and "response_mask" in batch.keys():
                request["tokens"] = int(batch["response_mask"].sum())
        return output

    return generate_sequences


async def check_canary(replicas: list[Any], canary: Canary) -> float | None:
    """Every replica's prompt log-probs of the canary (through its server's ``generate``, as verl's agent loop asks it)
    against the trainer's; returns the largest mean deviation (None: no replica has a server to ask), raises
    ``CanaryError`` above the tolerance."""
    worst: float | None = None
    for i, replica in enumerate(replicas):
        server = getattr(replica, "_server_handle", None)
        if server is None:
            _say_unchecked(f"rollout replica {i} has no server (verl's hybrid engine without a server handle)")
            continue
        outputs = await asyncio.gather(*[
            server.generate.remote(prompt_ids=list(tokens), request_id=f"rlsync-canary-{uuid.uuid4().hex}",
                                   sampling_params={"max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0})
            for tokens in canary.tokens])
        # verl's extract_prompt_logprobs: [[log p(token j + 1)] for each position j], then one padding entry
        logprobs = [[row[0] for row in out.extra_fields["prompt_logprobs"][: len(tokens) - 1]]
                    for out, tokens in zip(outputs, canary.tokens)]
        deviation = canary.check(logprobs, where=f"verl's rollout replica {i}")
        worst = deviation if worst is None else max(worst, deviation)
    return worst

