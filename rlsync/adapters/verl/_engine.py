"""The ``rlsync`` checkpoint engine for verl (``verl/checkpoint_engine/base.py``, ``CheckpointEngine``).

Per sync verl calls, on every actor rank and every rollout worker, ``prepare`` (metadata), then in the driver
``build_topology``, then ``init_process_group`` with each worker's part of the topology, then concurrently
``send_weights`` (actor ranks: each must drain its generator, FSDP's ``full_tensor`` is collective) and
``receive_weights`` (rollout workers: the async generator goes to verl's server adapter), then ``finalize``.

Here **every actor rank sends**: the plan gives rank ``r`` of ``N`` the ``r``-th row chunk of every tensor
(FSDP ``Shard(0)`` semantics) and it sends that chunk, once, to every rollout worker; the rollout workers
each hold a whole copy (``WeightsReader(None, None, r, replicas=M)``: the tensor list comes from the
trainer's first hello, so nothing needs configuring). While draining, a rank keeps only its chunk (a host
copy, 1/N of the model), never the whole model. A version goes to verl's server adapter only once every
byte from every actor rank has landed (and, with ``verify``, its checksums match); the actor ranks'
``send_weights`` return only once the rollout side has consumed it. A rank that dies mid-sync leaves the
rollout side on the previous step: its ``receive_weights`` times out and verl's manager raises.

LoRA: verl 0.9 hands a checkpoint engine what ``get_per_tensor_param()`` yields with its defaults. With
``actor_rollout_ref.model.lora.merge=True`` that is the merged model (base + adapter), which syncs like any model.
With ``merge=False`` it is the **base model alone**, renamed ``...q_proj.base_layer.weight`` (verl's
``collect_lora_params(base_sync_done=False)`` and ``replace_lora_wrapper``), no adapter tensor and no adapter
config: the rollout would sample from the initial policy for the whole run (verl issue #7495). rlsync's patches of
verl (``rlsync.adapters.verl._workers``) make the trainer worker hand this backend the adapter instead (``base_sync_done=
True``: its A/B matrices and PEFT config), which crosses alone, its configuration beside it as one more buffer
(``ADAPTER_CONFIG``, JSON), and the rollout worker hand it to verl's server adapter with ``peft_config`` and
``base_sync_done=True``, as verl's own colocated sync does: the rollout serves it as its LoRA adapter. Without the
patches (another verl version) the base alone is refused at the first tensor, naming ``lora.merge=True``.

Hosts of several rollout workers: see ``_relays`` (one ``NodeRelay`` per such host, option ``rlsync.relay``).

**The engine route** (``_engine_route``, verl's vLLM rollout, the trainer sending its own shards): the readers are not
the rollout workers' but rlsync's weight-transfer backend inside each vLLM worker, which receives only its slice of
every tensor (one ``WeightsWriter`` per replica on each trainer rank, learning the replica's layout from its
workers); the replica's leader drives the version through verl's ``collective_rpc``. Everything above about a
version's atomicity holds there too; it needs the trainer's tensor list at the engine's init, which trainer rank 0
gives in ``prepare`` (``tensor_source``, set by rlsync's patch of verl's trainer worker).

Versions: rlsync's version counts syncs (it continues after the version a rollout worker serves, so a
restarted trainer is accepted); ``global_steps`` (which may be None) is reported in the metrics.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import time
from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import Any

import msgspec
import torch
from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from rlsync import (
    Canary,
    ConfigError,
    Finish,
    LandedVersions,
    NodeRelay,
    Region,
    SyncOptions,
    TensorMeta,
    WeightMismatchError,
    WeightsReader,
    WeightsWriter,
)
from rlsync.adapters.verl._engine_route import EngineDriver, engine_topology, route_refusal, say_worker_route
from rlsync.adapters.verl._relays import host_id, place, relay_mode
from rlsync.core import HostStaging, host_port, keyed, rank_address, record_from_now, split_address
from rlsync.layouts import fsdp


def for_server_adapter(tensor: torch.Tensor, bucket_size: int, device: torch.device | None) -> torch.Tensor:
    """What verl's vLLM server adapter can take (``BucketedWeightSender``, ``vllm_rollout/bucketed_weight_transfer.py``):
    it copies a tensor that fits its bucket into the bucket buffer, from wherever it is, and shares a larger one as it
    is by CUDA IPC (``reduce_tensor``), which needs device memory. So on a GPU (``device``) a tensor larger than the
    bucket is copied to the device first (one such tensor at a time: the sender has passed it on before asking for
    the next); smaller ones stay in rlsync's host staging. Without a GPU verl's adapter uses shared memory and takes
    only tensors that fit its bucket (it says so, naming ``update_weights_bucket_megabytes``)."""
    if device is None or tensor.numel() * tensor.element_size() <= bucket_size:
        return tensor
    return tensor.to(device)


def refuse_base_without_adapter(name: str) -> None:
    """A ``.base_layer.`` name is a LoRA model's base weight under its PEFT wrapper's name: what verl hands a checkpoint
    engine without the adapter (see the module docstring)."""
    if ".base_layer." in name:
        raise ConfigError(f"verl handed the checkpoint engine {name!r}: a LoRA model's base weights without its adapter "
                          "(verl 0.9 syncs only the base model to a checkpoint engine when the adapter is not merged), "
                          "so the rollout would keep sampling from the initial policy. Set "
                          "actor_rollout_ref.model.lora.merge=True: the merged weights are synced")


#: the sync metric that carries the trainer's canary (plain data) to verl's manager, whose patch takes it out and checks
#: it on every replica (``rlsync.adapters.verl._workers``)
CANARY_METRIC = "rlsync/_canary"

#: the buffer that carries a LoRA adapter's PEFT configuration (``LoraConfig.to_dict()`` as JSON) beside its tensors
ADAPTER_CONFIG = "rlsync.peft_adapter_config"


def adapter_config_tensor(peft_config: dict[str, Any]) -> torch.Tensor:
    """``peft_config`` as the bytes of its JSON (sets, as ``target_modules`` may be, become sorted lists)."""
    return torch.frombuffer(bytearray(json.dumps(peft_config, default=sorted).encode()), dtype=torch.uint8)


_log = logging.getLogger("rlsync")
_ROUTES = {
    "shards": "each trainer rank sends its own local shards (verl's get_per_tensor_param_shard), in the rollout's dtype: "
              "nothing is gathered",
    "gathered": "each trainer rank gathers every tensor (verl's get_per_tensor_param) and sends its row chunk of it",
}
_DESTINATIONS = {
    True: "straight into each vLLM worker's own slice (rlsync's weight-transfer backend in the engine)",
    False: "to every rollout worker, which hands the whole model to verl's server adapter",
}


def timeline_option(engine_kwargs: Any) -> None:
    """``engine_kwargs.rlsync.timeline=DIR``: every process that builds this backend (trainer ranks, rollout workers)
    and verl's driver (its ``CheckpointEngineManager``) record the run's timeline into ``DIR``, a file each
    (``rlsync.core.record_from_now``); ``rlsync timeline DIR`` reads them together."""
    where = (engine_kwargs or {}).get("timeline")
    if where:
        if not isinstance(where, str):
            raise ConfigError(f"actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.timeline={where!r}: give "
                              "a directory (every process of the run records a file there)")
        record_from_now(where)


@functools.cache
def _say_route_once(route: str, engine: bool) -> None:
    _log.info("rlsync: verl's weight sync takes the %s route: %s, %s", route, _ROUTES[route], _DESTINATIONS[engine])


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@CheckpointEngineRegistry.register("rlsync")
class RlsyncCheckpointEngine(CheckpointEngine):  # type: ignore[misc]  # verl is untyped
    """verl checkpoint-engine backend ``rlsync``; see the module docstring."""

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        # bucket_size: rlsync moves each rank's chunk of every tensor straight into the readers' memory, no bucket; it
        # is also the bucket of verl's server adapter, which takes what receive_weights yields (see there).
        self.bucket_size = int(bucket_size)
        # engine_kwargs: what the user set under +...checkpoint_engine.engine_kwargs.rlsync (SyncOptions' keys)
        # sampling_mask: the actor's (_sampling); episodes: the agent loop's (_episodes)
        # relay: where a NodeRelay goes (_relays)
        # timeline: where this process records the run's timeline (see timeline_option)
        self._relay_mode = relay_mode(engine_kwargs.get("relay", "auto"))
        timeline_option(engine_kwargs)
        engine_kwargs = {k: v for k, v in engine_kwargs.items() if k not in ("sampling_mask", "episodes", "relay", "timeline")}
        self.options = SyncOptions.from_mapping(engine_kwargs, where="actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync")
        if self.options.codec is not None:
            raise ConfigError(f"engine_kwargs.rlsync.wire={self.options.wire!r}: use 'full' or 'delta'")
        self.role: str | None = None  # "actor" or "rollout", known from init_process_group on
        self._address: str | None = None
        self._relay_address: str | None = None  # this rollout worker's relay's, should it lead its host's
        self._relay: NodeRelay | None = None
        self._placement: tuple[Any, ...] = ()
        self._readers: list[str] = []
        self._rank, self._world = 0, 1
        self._writers: list[WeightsWriter] = []  # one per destination (the rollout's readers, or each engine replica)
        self._engine_route = False  # this sync's readers are the vLLM workers' (_engine_route)
        # a trainer rank: what its model sends on the shard route ([[name, dtype, shape], ...]; None: that route does
        # not apply), computed once, by rank 0, for the engines' init (set by rlsync's patch of verl's trainer worker)
        self.tensor_source: Any = None
        self._tensor_list: list[list[Any]] | None | bool = False  # False: not asked yet
        # a rollout worker: why its engine cannot take its slice itself (None: it can), and its hold on it
        self._route_refusal: str | None = "verl's CheckpointEngineWorker did not hand rlsync its server adapter"
        self._server_adapter: Any = None
        self._rollout_config: Any = None
        self._engine_driver: EngineDriver | None = None
        self._engine_tensors: list[list[Any]] = []
        self._chunks: dict[str, torch.Tensor] = {}  # this actor rank's share of every tensor (host memory, reused)
        self._shard_rank: int | None = None  # the shard route's writer rank (its place in the trainer's mesh)
        self._host = HostStaging()
        self._version = 0
        self._reader: WeightsReader | None = None
        self._landed = LandedVersions(self.options.timeout)
        self._next: tuple[int, dict[str, Region], Finish] | None = None  # taken early (landed_adapter_config)

    # -- topology ---------------------------------------------------------------------------------

    def attach_rollout(self, server_adapter: Any, rollout_config: Any) -> None:
        """A rollout worker's server adapter and config (rlsync's patch of verl's ``CheckpointEngineWorker``): whether
        its engine can take its own slice (``_engine_route``)."""
        self._server_adapter, self._rollout_config = server_adapter, rollout_config
        self._route_refusal = route_refusal(server_adapter, rollout_config)

    def prepare(self) -> dict[str, Any]:
        if self.tensor_source is not None or self.role == "actor":  # a trainer rank
            if self._tensor_list is False:
                self._tensor_list = None if self.tensor_source is None else self.tensor_source()
            return {"host": host_id(), **({} if self._tensor_list is None else {"tensors": self._tensor_list})}
        if self._address is None:  # reserved now, bound by the rollout worker's reader in init_process_group
            self._address = keyed(f"tcp://{self.options.host}:{_free_port(self.options.host)}", self.options.secret)
            self._relay_address = keyed(f"tcp://{self.options.host}:{_free_port(self.options.host)}", self.options.secret)
        if self._route_refusal is None and self._engine_driver is None:
            self._engine_driver = EngineDriver(self._server_adapter, self._rollout_config, self.options)
        engine = None if self._engine_driver is None else self._engine_driver.metadata()
        return {"address": self._address, "host": host_id(), "relay_address": self._relay_address, "relay": self._relay_mode,
                "engine": engine, "worker_route_because": self._route_refusal}

    @classmethod
    def build_topology(cls, actor_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        tensors = metadata[0].get("tensors") if actor_world_size else None
        engines = [m.get("engine") for m in metadata[actor_world_size:]]
        if tensors is not None and engines and all(engines):
            return engine_topology(actor_world_size, rollout_world_size, tensors, [e for e in engines if e])
        if tensors is None:
            say_worker_route("the trainer does not send its own shards")
        else:
            say_worker_route(next(m.get("worker_route_because") or "" for m in metadata[actor_world_size:] if not m.get("engine")))
        addresses = [m["address"] for m in metadata[actor_world_size:]]
        placed = place([m.get("host") for m in metadata[:actor_world_size]], metadata[actor_world_size:])
        # each actor rank gets its own credential for every reader (derived here, in verl's driver): a rank cannot
        # speak for another; with a shared secret (addresses without a key) every rank holds the same one
        own = [[rank_address(a, r) if split_address(a)[1] else a for a in placed.entries] for r in range(actor_world_size)]
        actor: dict[str, list[Any]] = {"role": ["actor"] * actor_world_size, "rank": list(range(actor_world_size)),
                 "world_size": [actor_world_size] * actor_world_size, "readers": own}
        rollout: dict[str, list[Any]] = {"role": ["rollout"] * rollout_world_size, "rank": list(range(rollout_world_size)),
                   "world_size": [rollout_world_size] * rollout_world_size, "readers": [addresses] * rollout_world_size,
                   "reader": placed.reader, "behind_relay": placed.behind, "relay": placed.relay}
        return actor, rollout

    def init_process_group(self, role: str, rank: int, world_size: int, readers: list[Any],
                           reader: Sequence[int] | None = None, behind_relay: bool = False,
                           relay: dict[str, Any] | None = None, engine: bool = False,
                           engine_tensors: list[list[Any]] | None = None) -> None:
        """``reader``: this rollout worker's ``(rank, replicas)`` among the trainer's readers (by default its rank among
        ``world_size``); ``behind_relay``: its bytes come from its host's relay; ``relay``: the ``NodeRelay`` it runs for
        that host (all three from ``_relays.place``). The engine route: ``engine`` (a trainer rank: ``readers`` holds
        each replica's workers' addresses), ``engine_tensors`` (a rollout worker: what its leader inits the engine
        with)."""
        reader_rank, replicas = (rank, world_size) if reader is None else (int(reader[0]), int(reader[1]))
        placement = (rank, world_size, list(readers), reader_rank, replicas, behind_relay, relay, engine, engine_tensors is not None)
        changed = self._placement != placement
        self._placement = placement
        self.role, self._rank, self._world, self._readers = role, rank, world_size, list(readers)
        self._engine_route = engine or engine_tensors is not None
        if role == "actor":
            if changed:  # the rollout side changed (elastic scaling, another route): new plans
                self._close_writers()
            return
        if engine_tensors is not None:  # the vLLM workers receive; this worker's leader drives them
            self._close_rollout()
            self._engine_tensors = engine_tensors
            return
        if self._reader is not None and not changed:
            return
        self._close_rollout()
        host, port = host_port(readers[rank])
        key = split_address(readers[rank])[1] or self.options.secret  # the key prepare() put in its address
        # behind a relay: its bytes come from the relay over shared memory, whole
        options = self.options.replace(transport="shm", wire="full") if behind_relay else self.options
        self._reader = WeightsReader(None, None, reader_rank, replicas=replicas, options=options.replace(host=host, port=port, secret=key),
                                     landing="staged", on_version=self._landed.on_version, on_refused=self._landed.on_refused,
                                     on_lost=self._landed.on_lost)
        receiver = self._reader
        self._landed.refusal = lambda: receiver.refusal  # a refused trainer fails the rollout's wait at once
        if relay is not None:  # this worker leads its host: the trainer's writers send to its relay
            relay_host, relay_port = host_port(relay["address"])
            relay_key = split_address(relay["address"])[1] or self.options.secret
            self._relay = NodeRelay([[address] for address in relay["local"]], rank=relay["rank"], replicas=relay["replicas"],
                                    replica_engines=True,  # the host's other workers may not be up yet
                                    options=self.options.replace(host=relay_host, port=relay_port, secret=relay_key),
                                    local=self.options.replace(transport="shm", wire="full"))

    def _close_rollout(self) -> None:
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _close_writers(self) -> None:
        for writer in self._writers:
            writer.close()
        self._writers = []

    def finalize(self) -> None:
        pass  # readers, landing memory and links are kept for the next sync

    # -- actor ranks ------------------------------------------------------------------------------

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Any,
                           global_steps: int | None = None, peft_config: dict[str, Any] | None = None,
                           canary: Canary | None = None) -> dict[str, Any]:
        """``peft_config``: ``weights`` are a LoRA adapter's; ``canary``: the trainer's, for verl's manager to check on
        the replicas once they serve again (both passed by rlsync's patch of verl's trainer worker)."""
        started = time.perf_counter()
        metas: list[TensorMeta] = []
        async for name, tensor in ensure_async_iterator(weights):  # drain it all: every rank takes part in each full_tensor()
            if peft_config is None:
                refuse_base_without_adapter(name)  # every rank at the same tensor: none is left in a collective
            metas.append(TensorMeta(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)))
            self._keep_my_chunk(metas[-1], tensor)  # and the full tensor can go
        if peft_config is not None:
            config = adapter_config_tensor(peft_config)
            metas.append(TensorMeta(ADAPTER_CONFIG, "uint8", tuple(config.shape)))
            self._keep_my_chunk(metas[-1], config)
        if self._engine_route:  # never: a trainer that gathers offers no tensor list, so its sync keeps the worker route
            raise ConfigError("the rollout engines expect this trainer's own shards, but it gathered every tensor")
        src = fsdp(metas, self._world)
        self._shard_rank = None
        mine = {s.buffer for s in src.shards if s.rank == self._rank}
        return await self._send(src, mine, global_steps, canary, started, route="gathered", peft_config=peft_config)

    async def send_shards(self, shards: Any, global_steps: int | None = None,
                          canary: Canary | None = None) -> dict[str, Any]:
        """This rank's own local parameters (``_shards.TrainerShards``: every rank's layout, this rank's writer rank
        in it, its buffers: verl's FSDP2 shards or a megatron-core chunk's parameters, in the dtype the rollout serves,
        taken without a collective), each byte sent once: nothing is gathered."""
        started = time.perf_counter()
        self._shard_rank = shards.rank
        for name, tensor in shards.buffers.items():  # staged to reused host buffers (pinned where CUDA runs)
            self._chunks[name] = self._host.stage(name, tensor)
        self._host.wait()
        return await self._send(shards.layout, set(shards.buffers), global_steps, canary, started, route="shards")

    async def _send(self, src: Any, mine: Any, global_steps: int | None, canary: Canary | None, started: float, *,
                    route: str, peft_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send this rank's chunks of ``src`` (``mine``: the buffers it holds) as the next version; the step's
        metrics."""
        if not self._writers or self._writers[0].src != src:
            self._close_writers()
            # the engine route: one writer per replica, each learning its replica's layout from its workers
            destinations = self._readers if self._engine_route else [self._readers]
            self._writers = [WeightsWriter(src, None, self._rank_in(src), addresses, options=self.options)
                             for addresses in destinations]
            self._version = max(w.next_version for w in self._writers) - 1
        self._version += 1
        writers = self._writers
        if mine:
            chunks = {name: chunk for name, chunk in self._chunks.items() if name in mine}
            for writer in writers:
                writer.multi_put(chunks)
        sent = time.perf_counter()
        try:
            if mine:
                await asyncio.gather(*(asyncio.to_thread(w.complete, self._version) for w in writers))
        except WeightMismatchError as exc:
            raise WeightMismatchError(f"verl step {global_steps}: {exc}") from exc
        seconds = time.perf_counter() - started
        planned = sum(w.bytes_per_version for w in writers) if mine else 0
        wire = sum(w.last_bytes for w in writers) if mine else 0
        if wire > planned:
            _log.warning("rlsync: verl step %s: trainer rank %d sent %d bytes, the plan gives it %d", global_steps,
                         writers[0].rank, wire, planned)
        _say_route_once(route, self._engine_route)
        bytes_sent = sum(w.stats.bytes_sent for w in writers)
        return {"rlsync/version": -1 if global_steps is None else global_steps, "rlsync/sync_version": self._version,
                "rlsync/adapter_only": float(peft_config is not None), "rlsync/gathered": float(route != "shards"),
                "rlsync/engine_route": float(self._engine_route), "rlsync/bytes": bytes_sent,
                "rlsync/max_bytes_per_sender": max(w.stats.max_sender_bytes for w in writers),
                # the plan's bytes into the busiest reader: on the engine route one vLLM worker's slice
                "rlsync/max_bytes_per_receiver": max(w.stats.max_receiver_bytes for w in writers),
                "rlsync/receivers": sum(w.stats.receivers for w in writers),
                "rlsync/senders": writers[0].stats.senders, "rlsync/seconds": seconds, "rlsync/rank_wire_bytes": wire,
                "rlsync/rank_plan_bytes": planned,
                "rlsync/transfer_seconds": time.perf_counter() - sent, "rlsync/gbps": bytes_sent / seconds / 1e9,
                **({} if canary is None else {CANARY_METRIC: msgspec.structs.asdict(canary)})}

    def _rank_in(self, src: Any) -> int:
        """This rank's writer rank in ``src``: its actor rank for the gathered route's row chunks; for the shard route,
        its place in the trainer's device mesh (the same on verl's FSDP mesh)."""
        return self._shard_rank if self._shard_rank is not None else self._rank

    def _keep_my_chunk(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        """Copy this rank's part of ``tensor`` (its box in ``fsdp([meta], world)``: a row chunk) to host memory."""
        boxes = [s.box for s in fsdp([meta], self._world).shards if s.rank == self._rank]
        if not boxes:
            return
        [box] = boxes
        part = tensor.detach()[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))]
        # a reused host buffer (pinned where CUDA runs); waited for at once: the generator's next full_tensor()
        # may need the memory this one holds
        self._chunks[meta.name] = self._host.stage(meta.name, part)
        self._host.wait()

    # -- rollout workers --------------------------------------------------------------------------

    async def drive_engine(self, global_steps: int | None) -> None:
        """The engine route's version on this rollout worker's engine (its replica's leader drives it)."""
        assert self._engine_driver is not None
        await self._engine_driver.sync(self._engine_tensors, global_steps)

    @property
    def engine_route(self) -> bool:
        """This sync goes straight into the rollout's vLLM workers (a rollout worker's view)."""
        return self.role == "rollout" and self._engine_route

    async def _take_next(self) -> tuple[int, dict[str, Region], Finish]:
        """The version ``landed_adapter_config`` took early, or the next one to land."""
        if self._next is not None:
            return self._next
        return await asyncio.to_thread(self._landed.next, self.options.timeout)

    async def landed_adapter_config(self) -> dict[str, Any] | None:
        """Wait for the next version (``receive_weights`` then yields it); the PEFT configuration it came with when it
        is a LoRA adapter, else None."""
        self._next = taken = await self._take_next()
        buffers = taken[1]
        if ADAPTER_CONFIG not in buffers:
            return None
        return dict(json.loads(torch.as_tensor(buffers[ADAPTER_CONFIG]).numpy().tobytes()))

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        (_, buffers, finish), self._next = await self._take_next(), None
        reader = self._reader
        assert reader is not None and reader.dst is not None
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        try:
            for meta in reader.dst.tensors:
                if meta.name == ADAPTER_CONFIG:
                    continue  # handed to the server adapter as peft_config (landed_adapter_config)
                landed = torch.as_tensor(buffers[meta.name]).view(getattr(torch, meta.dtype)).view(meta.shape)
                yield meta.name, for_server_adapter(landed, self.bucket_size, device)
        except BaseException as exc:  # the server adapter failed (or stopped early): the version is refused
            finish(exc)
            raise
        finish(None)
