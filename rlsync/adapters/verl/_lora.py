"""An unmerged LoRA adapter through verl's ``rlsync`` backend (applied by ``rlsync.patches.verl``).

Trainer worker (``ActorRolloutRefWorker.update_weights``): verl asks its model engine for ``get_per_tensor_param()``
with the defaults, which for an unmerged adapter is the base model alone. With the ``rlsync`` backend it asks with
``base_sync_done=True``, as verl's own colocated sync does once the rollout holds the base: the adapter's A/B
matrices and its PEFT configuration, which go to ``RlsyncCheckpointEngine.send_weights`` (for a model without an
unmerged adapter the same call yields what the defaults yield). Rollout worker
(``CheckpointEngineWorker.update_weights``): the version's configuration, if it came with one, goes to verl's server
adapter as ``peft_config`` with ``base_sync_done=True``; verl's vLLM adapter then replaces its LoRA adapter with the
new one (``update_weights_from_ipc``) and its server generates with it. Any other backend runs verl's code unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

from rlsync import ConfigError
from rlsync.adapters.verl._engine import RlsyncCheckpointEngine


def actor_update_weights(original: Any) -> Any:
    @functools.wraps(original)
    async def update_weights(self: Any, global_steps: int | None = None, mode: str = "auto") -> Any:
        backend = mode if mode != "auto" else self.config.rollout.checkpoint_engine.backend
        if backend == "naive" or not isinstance(getattr(self, "checkpoint_engine", None), RlsyncCheckpointEngine):
            return await original(self, global_steps=global_steps, mode=mode)
        params, peft_config = self.actor.engine.get_per_tensor_param(layered_summon=self.layered_summon,
                                                                     base_sync_done=True)
        if peft_config is not None and not getattr(self, "base_sync_done", True):
            raise ConfigError("the rollout starts from dummy weights (actor_rollout_ref.rollout.load_format=dummy) and "
                              "the LoRA adapter is not merged: rlsync sends the adapter alone, so the rollout must load "
                              "the base model itself. Set rollout.load_format=auto, or lora.merge=True")
        return await self.checkpoint_engine.send_weights(params, global_steps=global_steps, peft_config=peft_config) or {}

    return update_weights


def rollout_update_weights(original: Any) -> Any:
    @functools.wraps(original)
    async def update_weights(self: Any, global_steps: int | None = None) -> None:
        engine = self.checkpoint_engine
        if not isinstance(engine, RlsyncCheckpointEngine):
            return await original(self, global_steps=global_steps)  # type: ignore[no-any-return]
        peft_config = await engine.landed_adapter_config()
        adapter = {} if peft_config is None else {"peft_config": peft_config, "base_sync_done": True}
        await self.server_adapter.update_weights(engine.receive_weights(global_steps=global_steps),
                                                 global_steps=global_steps, wire_format="named_tensors", **adapter)
        return None

    return update_weights
