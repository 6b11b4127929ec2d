"""Version-guarded patches of verl, applied when verl loads rlsync's backend (its ``verl.plugins`` entry point, in
every process that imports verl: the driver, the trainer workers, the rollout workers).

verl hands a checkpoint engine neither a LoRA adapter nor its configuration (0.9: the trainer worker asks
``get_per_tensor_param()`` with its defaults, the base model alone when the adapter is not merged; the rollout
worker calls its server adapter without ``peft_config``), nor the model a canary needs. For the ``rlsync`` backend
only:

- ``ActorRolloutRefWorker.update_weights`` (``verl.workers.engine_workers``) is wrapped by the given decorator;
- ``CheckpointEngineWorker.update_weights`` (``verl.checkpoint_engine.base``) is wrapped by the given decorator;
- ``CheckpointEngineManager.update_weights`` (the driver's) is wrapped by the given decorator: the canary's check;
- ``ActorRolloutRefWorker.execute_checkpoint_engine``, ``CheckpointEngineWorker.__init__`` and
  ``RolloutConfig.__post_init__`` (``verl.workers.config``) are wrapped by the given decorators: the engine route
  (the trainer's tensor list for the engines' init, the rollout worker's server adapter, vLLM's
  ``weight_transfer_config``).

Independently of the backend, for verl's rollout routing replay (R3) with an FSDP actor (``apply_routing_replay``):
``ActorRolloutRefWorker.__init__``, ``FSDPEngineWithLMHead.forward_step`` and ``FSDPEngine.forward_backward_batch``
(``verl.workers.engine.fsdp.transformer_impl``) are wrapped by the given decorators.

For the sampling mask of an FSDP actor (``apply_sampling_mask``): ``ActorRolloutRefWorker.__init__``,
``compute_log_prob`` and ``update_actor``, and ``FSDPEngineWithLMHead.forward_step`` are wrapped by the given
decorators; ``transformer_impl.logprobs_from_logits`` (the name ``prepare_model_outputs`` looks up) by the given one.

For the timeline (``apply_timeline``, called by the driver's first weight sync with ``engine_kwargs.rlsync.timeline``
set): ``RayPPOTrainer._update_actor`` (``verl.trainer.ppo.ray_trainer``) and ``AgentLoopManager.generate_sequences``
(``verl.experimental.agent_loop.agent_loop``) are wrapped by the given decorators.

For durable episodes (``apply_episodes``): ``AgentLoopWorker._run_agent_loop`` is wrapped by the given decorator
(it hands the agent loop verl's trajectory, and runs ``tool_agent`` in rlsync's loop when episodes are configured).

All are wrapped in place (``functools.wraps`` keeps verl's ``@register`` dispatch attributes), before Ray pickles the
worker classes. Supported verl versions: ``SUPPORTED``; with another, nothing is patched (said once in the log) and
rlsync refuses an unmerged LoRA by name, as before.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from rlsync.patches import minor_supported

SUPPORTED = ("0.9",)  # verl major.minor versions whose code these patches were written against


def apply(*, actor_update_weights: Callable[[Any], Any], rollout_update_weights: Callable[[Any], Any],
          manager_update_weights: Callable[[Any], Any], actor_execute_checkpoint_engine: Callable[[Any], Any],
          rollout_init: Callable[[Any], Any], rollout_config_init: Callable[[Any], Any]) -> None:
    """Wrap both workers' and the manager's ``update_weights``, and the engine route's three (once); a log line instead
    when this verl is not a supported one, or its trainer worker does not import here."""
    version = metadata.version("verl")
    if not minor_supported(version, SUPPORTED):
        logging.getLogger("rlsync").warning(
            "rlsync: verl %s is not one rlsync's LoRA patches were written for (%s): an unmerged LoRA adapter is not "
            "synced (set actor_rollout_ref.model.lora.merge=True), no canary is checked, and an FSDP actor's log-probs do "
            "not reapply the rollout's top-k/top-p", version,
            ", ".join(v + ".x" for v in SUPPORTED))
        return
    from verl.checkpoint_engine.base import CheckpointEngineManager, CheckpointEngineWorker
    from verl.workers.config import RolloutConfig

    try:
        from verl.workers.engine_workers import ActorRolloutRefWorker
    except ImportError as exc:  # verl swallows a plugin's import error: say it here, and keep the backend registered
        logging.getLogger("rlsync").warning("rlsync: verl's trainer worker does not import here (%s): its LoRA adapter "
                                            "and canary patches are not applied in this process", exc)
        return

    for cls, wrap in ((ActorRolloutRefWorker, actor_update_weights), (CheckpointEngineWorker, rollout_update_weights),
                      (CheckpointEngineManager, manager_update_weights)):
        if not getattr(cls.update_weights, "_rlsync_patched", False):
            cls.update_weights = wrap(cls.update_weights)
            cls.update_weights._rlsync_patched = True
    _wrap_methods("_rlsync_patched", ((ActorRolloutRefWorker, "execute_checkpoint_engine", actor_execute_checkpoint_engine),
                                      (CheckpointEngineWorker, "__init__", rollout_init),
                                      (RolloutConfig, "__post_init__", rollout_config_init)))


def _wrap_methods(marker: str, methods: tuple[tuple[type, str, Callable[[Any], Any]], ...]) -> None:
    """Replace each ``(class, name, wrap)``'s own method by ``wrap(method)``, once: ``marker`` on the wrapped method
    says it is (one marker per group of patches, since several groups wrap the same class's ``__init__``)."""
    for cls, name, wrap in methods:
        method = cls.__dict__[name]
        if not getattr(method, marker, False):
            wrapped = wrap(method)
            setattr(wrapped, marker, True)
            setattr(cls, name, wrapped)


def apply_routing_replay(*, worker_init: Callable[[Any], Any], forward_step: Callable[[Any], Any],
                         forward_backward_batch: Callable[[Any], Any]) -> None:
    """Wrap the trainer worker's ``__init__`` and the FSDP engine's ``forward_step`` and ``forward_backward_batch``
    (once); a log line instead when this verl is not a supported one, or they do not import here."""
    version = metadata.version("verl")
    if not minor_supported(version, SUPPORTED):
        return  # apply() said so
    try:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead
        from verl.workers.engine_workers import ActorRolloutRefWorker
    except ImportError as exc:
        logging.getLogger("rlsync").warning("rlsync: verl's FSDP engine does not import here (%s): routing replay (R3) "
                                            "with an FSDP actor is not available in this process", exc)
        return
    _wrap_methods("_rlsync_routes", ((ActorRolloutRefWorker, "__init__", worker_init),
                                     (FSDPEngineWithLMHead, "forward_step", forward_step),
                                     (FSDPEngine, "forward_backward_batch", forward_backward_batch)))


def apply_sampling_mask(*, worker_init: Callable[[Any], Any], actor_call: Callable[[Any], Any],
                        forward_step: Callable[[Any], Any], log_probs: Callable[[Any], Any]) -> None:
    """Wrap the trainer worker's ``__init__``, ``compute_log_prob`` and ``update_actor``, the FSDP engine's
    ``forward_step`` and its module's ``logprobs_from_logits`` (once); nothing where this verl is not a supported one or
    they do not import here (routing replay's patch says so)."""
    if not minor_supported(metadata.version("verl"), SUPPORTED):
        return
    try:
        from verl.workers.engine.fsdp import transformer_impl
        from verl.workers.engine_workers import ActorRolloutRefWorker
    except ImportError:
        return
    if getattr(transformer_impl, "_rlsync_mask", False):
        return
    worker = ActorRolloutRefWorker
    worker.__init__ = worker_init(worker.__dict__["__init__"])
    worker.compute_log_prob = actor_call(worker.__dict__["compute_log_prob"])
    worker.update_actor = actor_call(worker.__dict__["update_actor"])
    engine = transformer_impl.FSDPEngineWithLMHead
    engine.forward_step = forward_step(engine.__dict__["forward_step"])
    transformer_impl.logprobs_from_logits = log_probs(transformer_impl.logprobs_from_logits)
    transformer_impl._rlsync_mask = True


def apply_timeline(*, update_actor: Callable[[Any], Any], generate_sequences: Callable[[Any], Any]) -> bool:
    """Wrap the driver's ``RayPPOTrainer._update_actor`` and ``AgentLoopManager.generate_sequences`` (once), where this
    process has imported them (verl's driver has, by its first weight sync; nothing is imported here for it): True
    where both are wrapped."""
    if not minor_supported(metadata.version("verl"), SUPPORTED):
        return False
    trainer = sys.modules.get("verl.trainer.ppo.ray_trainer")
    agent_loop = sys.modules.get("verl.experimental.agent_loop.agent_loop")
    methods = tuple((cls, name, wrap) for module, cls_name, name, wrap in (
        (trainer, "RayPPOTrainer", "_update_actor", update_actor),
        (agent_loop, "AgentLoopManager", "generate_sequences", generate_sequences))
        if (cls := getattr(module, cls_name, None)) is not None and name in cls.__dict__)
    _wrap_methods("_rlsync_timeline", methods)
    return len(methods) == 2


def apply_episodes(*, run_agent_loop: Callable[[Any], Any]) -> bool:
    """Wrap ``AgentLoopWorker._run_agent_loop`` (``verl.experimental.agent_loop.agent_loop``; verl's v1 worker
    inherits it) by the given decorator (once): True where it is wrapped, False where this verl is not a supported
    one or the agent loop does not import here."""
    if not minor_supported(metadata.version("verl"), SUPPORTED):
        return False
    try:
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    except ImportError as exc:
        logging.getLogger("rlsync").warning("rlsync: verl's agent loop does not import here (%s): durable episodes "
                                            "are not available in this process", exc)
        return False
    method = AgentLoopWorker.__dict__["_run_agent_loop"]
    if not getattr(method, "_rlsync_episodes", False):
        wrapped = run_agent_loop(method)
        wrapped._rlsync_episodes = True
        AgentLoopWorker._run_agent_loop = wrapped
    return True
