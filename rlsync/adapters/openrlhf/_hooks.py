"""Where the OpenRLHF patches are applied: the launcher's driver (``patch_trainer``), every Ray worker of
the launcher's cluster (``setup_worker``, Ray's ``worker_process_setup_hook``) and every vLLM process
(``register_vllm_plugin``, a ``vllm.general_plugins`` entry point: vLLM's engine processes are not Ray
workers, and they run their plugins before resolving ``worker_extension_cls``)."""

from __future__ import annotations

import os

from rlsync.patches.openrlhf import (
    OPTIONS_ENV,
    apply_engine_actor,
    apply_engine_side,
    apply_sampling_mask,
    apply_trainer_side,
    options,
)


def patch_engine_actor() -> None:
    """OpenRLHF's engine actor (``RolloutRayActor``): LoRA adapters, MoE routes, durable episodes."""
    from rlsync.adapters.openrlhf import _engine_actor, _episodes, _routes

    # episodes outside routes: a replayed turn or rollout never reached vLLM, and has no routes to take
    apply_engine_actor(wrap_init=_engine_actor.wrap_init, wrap_update_weight=_engine_actor.wrap_update_weight,
                       wrap_generate=lambda f: _episodes.wrap_generate(_routes.wrap_generate(f)),
                       wrap_generate_responses=lambda f: _episodes.wrap_generate_responses(_routes.wrap_generate_responses(f)))


def patch_trainer() -> None:
    """The trainer side, and OpenRLHF's engine actor (a Ray actor too: ``RolloutRayActor``)."""
    from rlsync.adapters.openrlhf import _episodes, _routes, _sampling, _trainer, _versions

    patch_engine_actor()
    apply_trainer_side(init_vllm_sync_group=_trainer.init_vllm_sync_group, broadcast_to_vllm=_trainer.broadcast_to_vllm,
                       tag_samples=_versions.tag_samples,
                       gate_samples=lambda step: _versions.gate_samples(step, (options() or {}).get("max_staleness")),
                       trainer_init=_routes.wrap_init, training_step=_routes.wrap_training_step,
                       process_response=lambda f: _episodes.wrap_process_response(_routes.wrap_process_response(f)),
                       routes_step=_routes.wrap_train_step, dispatch=_episodes.wrap_dispatch,
                       eval_samples=_episodes.wrap_eval_samples, checkpoint_states=_episodes.wrap_checkpoint_states,
                       generator_fit=_episodes.wrap_generator_fit)
    apply_sampling_mask(policy_init=_sampling.wrap_policy_init, actor_forward=_sampling.wrap_forward,
                        log_probs=_sampling.masked_log_probs, entropy=_sampling.masked_entropy)


def setup_worker() -> None:
    """Ray's ``worker_process_setup_hook``: every Ray worker the launcher's cluster starts runs this first."""
    if options() is not None:
        patch_trainer()


def register_vllm_plugin() -> None:
    """rlsync's OpenRLHF entry in ``vllm.general_plugins``: in a run of ``rlsync launch openrlhf`` only."""
    if os.environ.get(OPTIONS_ENV):
        from rlsync.adapters.openrlhf._worker import RlsyncWorkerWrap

        apply_engine_side(RlsyncWorkerWrap)
