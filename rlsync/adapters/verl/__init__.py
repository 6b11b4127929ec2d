"""verl: the checkpoint-engine backend ``rlsync``.

A verl user adds one flag, ``actor_rollout_ref.rollout.checkpoint_engine.backend=rlsync``; ``import verl``
imports this module through the ``verl.plugins`` entry point, which registers the backend
(``custom_backend_module=rlsync.adapters.verl`` does the same explicitly). Options, all optional:
``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.KEY=V`` with KEY one of ``transport``
(``shm`` on one machine, ``nixl`` or ``tcp`` across machines), ``host`` (the address rollout workers listen
on; loopback by default), ``verify`` (checksums per tensor: a mismatch is an error naming the tensor and the
step), ``timeout`` (seconds a sync may take), ``canary`` (default true: the trainer's canary checked on every
replica after each sync, ``rlsync/canary_deviation`` in the step's metrics).

LoRA: merged (``lora.merge=True``) syncs the merged model; unmerged, the adapter alone crosses and verl's server
adapter serves it as its LoRA adapter (``rlsync.patches.verl`` hands it to the backend).

MoE: verl's rollout routing replay (``actor.router_replay.mode=R3`` with ``rollout.enable_rollout_routing_replay``)
works with an FSDP actor too (``rlsync.adapters.verl._routes``), whatever the checkpoint backend.

Sampling mask: with ``rollout.top_k``/``top_p`` set, the FSDP actor's log-probs are those of the distribution vLLM
sampled from (``rlsync.adapters.verl._sampling``); ``engine_kwargs.rlsync.sampling_mask=false`` turns it off.

Durable episodes: with ``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.episodes=redis://HOST:6379/0``
verl's tool agent loop (``tool_agent``) records every turn and tool call in Redis, and a run restarted after a
crash replays what was recorded instead of generating it or calling its tools again (``rlsync.adapters.verl._episodes``).

Importing this module imports verl (it registers into verl's registry, and patches verl's workers' ``update_weights``
for this backend); importing ``rlsync`` does not.
"""

from __future__ import annotations

import logging

from rlsync.adapters.verl import _routes, _sampling, _workers
from rlsync.adapters.verl._engine import RlsyncCheckpointEngine
from rlsync.patches.verl import apply, apply_episodes, apply_routing_replay, apply_sampling_mask

# verl's workers hand this backend an unmerged LoRA adapter and its configuration, and its manager checks the trainer's
# canary on every replica (rlsync.patches.verl, rlsync.adapters.verl._workers)
apply(actor_update_weights=_workers.actor_update_weights, rollout_update_weights=_workers.rollout_update_weights,
      manager_update_weights=_workers.manager_update_weights,
      actor_execute_checkpoint_engine=_workers.actor_execute_checkpoint_engine, rollout_init=_workers.rollout_init,
      rollout_config_init=_workers.rollout_config_init)
# verl's rollout routing replay (R3: router_replay.mode=R3 with enable_rollout_routing_replay) in its FSDP engine, which
# verl itself implements for Megatron and VeOmni only (rlsync.adapters.verl._routes)
apply_routing_replay(worker_init=_routes.wrap_worker_init, forward_step=_routes.wrap_forward_step,
                     forward_backward_batch=_routes.wrap_forward_backward_batch)
# the actor's log-probs under the rollout's top-k/top-p, as vLLM reports them (rlsync.adapters.verl._sampling)
apply_sampling_mask(worker_init=_sampling.wrap_worker_init, actor_call=_sampling.wrap_actor_call,
                    forward_step=_sampling.wrap_forward_step, log_probs=_sampling.masked_log_probs)
# durable episodes: verl's tool agent loop recorded in Redis when engine_kwargs.rlsync.episodes is set
# (rlsync.adapters.verl._episodes); verl would swallow an import error of this module with the backend
try:
    from rlsync.adapters.verl import _episodes
except ImportError as exc:
    logging.getLogger("rlsync").warning("rlsync: verl's agent loop does not import here (%s): durable episodes "
                                        "(engine_kwargs.rlsync.episodes) are not available in this process", exc)
else:
    apply_episodes(run_agent_loop=_episodes.wrap_run_agent_loop)
    from rlsync.adapters.verl._episodes import RlsyncToolAgentLoop, tool_call_key

__all__ = ["RlsyncCheckpointEngine", "RlsyncToolAgentLoop", "tool_call_key"]
