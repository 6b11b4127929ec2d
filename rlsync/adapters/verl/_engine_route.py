"""verl's weight sync straight into the vLLM workers (issue #67): each tensor-parallel worker of a rollout replica runs
rlsync's weight-transfer backend (vLLM's ``weight_transfer_config={"backend": "rlsync"}``, which rlsync's patch of
verl's vLLM server sets for the user), learns its slice of every tensor from vLLM's own loader at init, receives only
those bytes, each from the trainer rank whose local shard holds them, and commits them into the parameters it
serves (in place where a parameter keeps its loaded shape, through vLLM's loader where it repacks), all or nothing.
No ``CheckpointEngineWorker`` lands a byte on this route.

The replica's leader (the rollout worker that holds verl's server handle, ``ServerAdapter._has_server``) drives the
version through verl's own path to its engine: ``ServerAdapter._execute_method``, the server actor's
``collective_rpc``, which reaches every worker of the replica, as verl's ``delta_sharded`` backend drives vLLM's
weight-transfer engine: ``init_weight_transfer_engine`` (once, with the trainer's tensor list), then per version
``start_weight_update``, ``update_weights`` (it returns once the version's bytes all landed and are loaded),
``update_weights`` with ``commit`` (the version goes live on every worker), ``finish_weight_update``, and the server's
``clear_kv_cache`` and ``set_global_steps`` as verl's adapter ends an update. Every init and update is signed
(``rlsync.adapters.vllm.RouteCredential``: verl's server may serve vLLM's dev-mode routes to HTTP clients); the
readers' key derives from the init and reaches the trainer ranks in verl's topology, each rank its own credential.

A replica the route cannot take (another engine than vLLM, data- or pipeline-parallel vLLM, prefill/decode
disaggregation, another ``weight_transfer_config`` the user set, a server adapter without verl's ``_execute_method``)
keeps the worker route (``_engine``), said once in the log; so does a trainer that cannot send its own shards.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from rlsync import ConfigError, SyncOptions
from rlsync.adapters.vllm import RouteCredential, reserve_ports
from rlsync.core import rank_address, with_key

_log = logging.getLogger("rlsync")

#: what rlsync's patch of verl's vLLM server puts in its engine arguments for the ``rlsync`` checkpoint backend
WEIGHT_TRANSFER_CONFIG = {"backend": "rlsync"}


def _get(config: Any, key: str, default: Any = None) -> Any:
    getter = getattr(config, "get", None)
    return getter(key, default) if callable(getter) else getattr(config, key, default)


def route_refusal(server_adapter: Any, rollout_config: Any) -> str | None:
    """Why this rollout worker's engine cannot take its slice itself (None: it can)."""
    if _get(rollout_config, "name") != "vllm":
        return f"the rollout engine is {_get(rollout_config, 'name')!r}, rlsync's backend runs inside vLLM"
    if not callable(getattr(server_adapter, "_execute_method", None)):
        return f"the server adapter {type(server_adapter).__name__} has no _execute_method (verl's vLLM ServerAdapter's)"
    for key in ("data_parallel_size", "pipeline_model_parallel_size"):
        if int(_get(rollout_config, key, 1) or 1) != 1:
            return f"rollout.{key}={_get(rollout_config, key)} (verl's collective_rpc reaches one DP shard's TP workers)"
    disaggregation = _get(rollout_config, "disaggregation")
    if disaggregation is not None and _get(disaggregation, "enabled", False):
        return "prefill/decode disaggregation"
    engine_kwargs = _get(_get(rollout_config, "engine_kwargs", {}) or {}, "vllm", {}) or {}
    configured = _get(engine_kwargs, "weight_transfer_config")
    if configured is not None and _get(configured, "backend") != "rlsync":
        return f"engine_kwargs.vllm.weight_transfer_config={configured} names another backend"
    return None


def engine_topology(actor_world_size: int, rollout_world_size: int, tensors: list[list[Any]],
                     engines: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """verl's topology on the engine route (``RlsyncCheckpointEngine.build_topology``): every trainer rank gets each
    replica's workers' addresses (its own credential for each), every rollout worker the tensor list its leader
    initialises the engine with."""
    leaders = {e["replica"]: e["addresses"] for e in engines if e["leader"]}
    missing = sorted({e["replica"] for e in engines} - set(leaders))
    if missing:
        raise ConfigError(f"rollout replicas {missing} have no leader worker (verl's server adapter with the server "
                          "handle) among the checkpoint engine's workers")
    own = [[[rank_address(a, r) for a in leaders[replica]] for replica in sorted(leaders)] for r in range(actor_world_size)]
    actor: dict[str, list[Any]] = {"role": ["actor"] * actor_world_size, "rank": list(range(actor_world_size)),
                                   "world_size": [actor_world_size] * actor_world_size, "readers": own,
                                   "engine": [True] * actor_world_size}
    rollout: dict[str, list[Any]] = {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size)),
                                     "world_size": [rollout_world_size] * rollout_world_size,
                                     "readers": [[]] * rollout_world_size, "engine_tensors": [tensors] * rollout_world_size}
    return actor, rollout


@functools.cache
def say_worker_route(why: str) -> None:
    _log.info("rlsync: verl's rollout workers receive every tensor and hand it to verl's server adapter: %s", why)


class EngineDriver:
    """A rollout worker's side of the route. On the replica's leader: the readers' addresses (one per worker, worker
    ``r`` binding port ``P + r``), the credential that signs the engine's init and updates, and the version it serves."""

    def __init__(self, server_adapter: Any, rollout_config: Any, options: SyncOptions) -> None:
        self.adapter, self.options = server_adapter, options
        self.leader = bool(getattr(server_adapter, "_has_server", False))
        self.replica = int(getattr(server_adapter, "replica_rank", 0))
        self.workers = int(_get(rollout_config, "tensor_model_parallel_size", 1) or 1)
        self.addresses: list[str] = []
        self._credential: RouteCredential | None = None
        self._tensors: list[list[Any]] | None = None  # what the engine was initialised with
        self.served = 0  # the version the engine serves (rlsync's count of syncs)
        if self.leader:
            self._credential = RouteCredential()
            self._base = reserve_ports(options.host, self.workers)
            self.addresses = [with_key(f"tcp://{options.host}:{self._base + r}", self._credential.reader_secret)
                              for r in range(self.workers)]

    def metadata(self) -> dict[str, Any]:
        return {"replica": self.replica, "leader": self.leader, "addresses": self.addresses}

    async def _rpc(self, method: str, **kwargs: Any) -> None:
        await self.adapter._execute_method(method, kwargs=kwargs)

    async def sync(self, tensors: list[list[Any]], global_steps: int | None) -> None:
        """One version into the engine (the leader; another worker of the replica has nothing to do: the leader's
        calls reach its engine worker)."""
        if not self.leader:
            return
        credential = self._credential
        assert credential is not None
        if self._tensors is None:
            info = {"address": f"tcp://{self.options.host}:{self._base}", "tensors": tensors,
                    "transport": self.options.to_mapping()["transport"], "verify": self.options.verify, "live_version": self.served}
            await self._rpc("init_weight_transfer_engine", init_info=credential.init(info))
            self._tensors = tensors
        elif tensors != self._tensors:
            raise ConfigError("the trainer's tensor list changed since the rollout engine was initialised with it "
                              "(names, dtypes or shapes): restart the run")
        version = self.served + 1
        await self._rpc("start_weight_update")
        # returns once this version landed whole on every worker and loaded; a trainer rank that dies, a timeout or a
        # loader error raises here and leaves every worker serving the previous version (vLLM ends the update itself)
        await self._rpc("update_weights", update_info=credential.update({"version": version, "timeout": self.options.timeout}))
        await self._rpc("update_weights", update_info=credential.update({"version": version, "commit": True}))
        await self._rpc("finish_weight_update")
        self.served = version
        server = self.adapter.server_handle  # as verl's adapter ends an update: no cached prefix of the old weights
        await server.clear_kv_cache.remote()
        if global_steps is not None:
            await server.set_global_steps.remote(global_steps)
