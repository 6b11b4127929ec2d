"""The trainer side of OpenRLHF with rlsync: ``ActorPPOTrainer._init_vllm_sync_group`` and
``ActorPPOTrainer.broadcast_to_vllm``, installed through ``rlsync.patches.openrlhf.apply_trainer_side``.

OpenRLHF's own sync sends every parameter from rank 0 (one Ray round trip and one NCCL broadcast per
parameter, after a ZeRO-3 gather of it). Here **every trainer rank sends its share**, each byte once into
every engine: with ZeRO-3 a rank's own partition of each parameter (``param.ds_tensor``, no gather); with
ZeRO-1/2 (every rank holds the whole parameter) rank ``r`` sends the ``r``-th of ``world`` flat parts. Each
engine worker receives only the part its loader reads (its tensor-parallel slice), and loads a version only
once all of it has landed from every rank (``rlsync.layouts.flat_partitions`` to the engine's layout).

``_init_vllm_sync_group`` (rank 0, as OpenRLHF calls it) is the handshake: the engines answer with their
workers' addresses only if their side is patched too; otherwise it fails at once, naming the side. Before it, where
the launcher's ``--relay`` says so, rank 0 asks Ray which node each engine runs on: the engines of a node of several
take their bytes over shared memory from an ``rlsync.NodeRelay`` in the first one's actor, and the trainer's ranks
send that node one copy (issue #40's node fan-out).

The canary (``rlsync.Canary``; launcher ``--no-canary`` turns it off): every rank computes the actor's log-probs of
a small fixed batch with the weights it sends (under ZeRO-3 that forward is collective, as OpenRLHF's own are);
the engines load the version and hold it, rank 0 runs the canary's prompts through each engine actor's
``generate`` and compares, then every engine keeps the version or, if any deviates, every engine undoes it and
every rank's sync raises ``CanaryError`` naming the deviation. The deviation goes to OpenRLHF's step status as
``rlsync/canary_deviation``. An engine that cannot generate while OpenRLHF syncs (``--train.partial_rollout_enable``
pauses it, ``--vllm.enable_sleep`` keeps its KV cache asleep) is not checked: said once.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any

import torch

from rlsync import Canary, ConfigError, SyncOptions, TensorMeta, WeightsWriter, __version__
from rlsync.adapters.openrlhf._engine_actor import adapter_sync, kept_versions, start_relay
from rlsync.adapters.openrlhf._versions import clock
from rlsync.adapters.openrlhf._worker import APPLY, HANDSHAKE, SETTLE
from rlsync.adapters.vllm import canary_sampling_params, prompt_logprobs_of
from rlsync.core import rank_address, split_address
from rlsync.layouts import flat_partitions
from rlsync.patches.openrlhf import installed_version, options
from rlsync.wire import lora_state

DEFAULTS: dict[str, Any] = {"transport": "shm", "host": "127.0.0.1", "timeout": 600.0, "canary": True}


def _options() -> dict[str, Any]:
    return {**DEFAULTS, **(options() or {})}


def _params(trainer: Any) -> list[tuple[str, Any, Any]]:
    """``(name in the engine's checkpoint, parameter, LoRA layer or None)`` of what OpenRLHF syncs, in its order (a
    VLM's frozen vision tower is left out, as OpenRLHF does). A LoRA actor (``--ds.lora.rank``) syncs its adapter
    alone (``_adapter_params``) when the launcher's ``--lora-sync`` is ``adapter`` (its default); with ``merged``,
    each adapted weight goes as base + its LoRA layer's delta, under the base model's names, and the adapter's own
    tensors are not sent."""
    model = trainer.actor.model.module
    if _adapter_only(model):
        return _adapter_params(model)
    is_vlm = getattr(trainer.actor, "is_vlm", False)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad or not is_vlm or "lora_" in n]
    if not hasattr(model, "peft_config"):
        return [(n, p, None) for n, p in params]
    if any(hasattr(p, "ds_tensor") for _, p in params):
        raise ConfigError("rlsync syncs a LoRA actor merged, and under ZeRO-3 each rank would need the whole adapter of "
                          "every layer gathered: not supported yet. Train the LoRA with --ds.zero_stage 2 (the adapter is "
                          "small: ZeRO-3 saves little memory on it), or run with --weight-sync openrlhf")
    synced = []
    for name, param in params:
        if "lora_" in name or ".original_module." in name:
            continue  # the adapter goes merged into its base weight; a modules_to_save copy replaces its original
        layer = model.get_submodule(name.rsplit(".base_layer", 1)[0]) if name.endswith(".base_layer.weight") else None
        plain = name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".modules_to_save.default", "")
        synced.append((plain, param, layer))
    return synced


def _adapter_only(model: Any) -> bool:
    """A LoRA actor in a run that syncs adapters (``adapter_sync``: the engines were built to serve them)."""
    adapter = adapter_sync(options())
    if not hasattr(model, "peft_config"):
        if adapter:
            raise ConfigError("rlsync launch openrlhf saw --ds.lora.rank, but the actor has no PEFT adapter: give "
                              "OpenRLHF and the launcher the same arguments")
        return False
    _say_lora_route(adapter)
    return adapter


@cache
def _say_lora_route(adapter: bool) -> None:
    if adapter:
        logging.getLogger("rlsync").info("rlsync: the LoRA actor syncs its adapter alone (A/B matrices) into engines "
                                         "serving it as an adapter")
    else:
        logging.getLogger("rlsync").warning("rlsync: the LoRA actor syncs merged (base + adapter, the whole model each "
                                            "version): --lora-sync merged")


def _adapter_params(model: Any) -> list[tuple[str, Any, Any]]:
    """The adapter's parameters under the names of its PEFT state dict (``rlsync.wire.lora_state``), what the engines'
    adapter receivers expect (checked once, ``_adapter_config``). Under ZeRO-3 each is partitioned like any
    parameter: every rank sends its partition."""
    return [(n.replace(".default.", "."), p, None) for n, p in model.named_parameters() if "lora_" in n]


def _adapter_config(model: Any) -> dict[str, Any]:
    """The adapter's PEFT configuration, once its tensors are known to be LoRA A/B matrices alone."""
    tensors, config = lora_state(model)
    names = {n for n, _, _ in _adapter_params(model)}
    if names != set(tensors):
        extra = sorted(set(tensors) - names)[:3]
        raise ConfigError(f"the adapter holds tensors other than LoRA A/B matrices ({extra}, modules_to_save?), which "
                          "rlsync's adapter-only sync into OpenRLHF's engines does not carry: rlsync launch openrlhf "
                          "--lora-sync merged")
    return config


def _meta(name: str, param: Any) -> TensorMeta:
    shape = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps the full shape in ds_shape
    return TensorMeta(name, str(param.dtype).removeprefix("torch."), tuple(int(x) for x in shape))


def init_vllm_sync_group(self: Any, backend: str) -> None:
    """Rank 0: check both sides are rlsync's and start every engine worker's reader (OpenRLHF's signature)."""
    import ray

    opts = _options()
    model = self.actor.model.module
    # the engines register every version as an adapter of this configuration
    adapter = {"lora": _adapter_config(model), "keep": kept_versions(opts)} if _adapter_only(model) else {}
    hello = {"rlsync": __version__, "openrlhf": installed_version(), "transport": opts["transport"],
             "host": opts["host"], "timeout": float(opts["timeout"]), "canary": bool(opts["canary"]),
             "tensors": [[m.name, m.dtype, list(m.shape)] for m in (_meta(n, p) for n, p, _ in _params(self))],
             **adapter}
    groups = _relay_groups(self.vllm_engines, opts, bool(adapter))
    behind = {i for group in groups for i in group}  # their bytes come from their host's relay, over shared memory
    local = {**hello, "transport": "shm", "host": "127.0.0.1"}
    refs = [engine.init_process_group.remote(HANDSHAKE + json.dumps(local if i in behind else hello), 0, 0, 0, "rlsync",
                                             backend, False) for i, engine in enumerate(self.vllm_engines)]
    try:
        answers = ray.get(refs, timeout=float(opts["timeout"]))
    except Exception as exc:
        text = str(exc)
        if HANDSHAKE in text or "rlsync" not in text:  # OpenRLHF's own WorkerWrap tried to rendezvous at our "address"
            raise ConfigError("OpenRLHF's vLLM engines are not patched by rlsync while its trainer side is: the engine "
                              "processes need rlsync installed beside vLLM (its vllm.general_plugins entry point patches "
                              "them) and the RLSYNC_OPENRLHF environment `rlsync launch openrlhf` sets") from exc
        raise
    # per reader of the trainer's: an engine's workers, one address each, or a relay's in place of its host's engines
    self._rlsync_addresses = _through_relays(self.vllm_engines, [list(a) for a in answers], groups, opts)
    self._rlsync_relays = len(groups)
    self._rlsync_version = 0


def _relay_groups(engines: list[Any], opts: dict[str, Any], adapter: bool) -> list[list[int]]:
    """The engines (indices) that share a host, per host of several, where the launcher's ``--relay`` puts a relay:
    ``auto`` where the transport crosses hosts (not ``shm``), ``on`` with any transport. An adapter sync needs none
    (its bytes are few)."""
    import ray

    mode = opts.get("relay", "auto")
    if adapter or len(engines) < 2 or mode == "off" or (mode == "auto" and opts["transport"] == "shm"):
        return []
    # the Ray node each engine actor runs on (asked before the handshake: any actor answers, patched or not)
    nodes = ray.get([engine.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id())
                     for engine in engines], timeout=float(opts["timeout"]))
    hosts: dict[str, list[int]] = {}
    for index, node in enumerate(nodes):
        hosts.setdefault(node, []).append(index)
    return [group for group in hosts.values() if len(group) > 1]


def _through_relays(engines: list[Any], addresses: list[list[str]], groups: list[list[int]],
                    opts: dict[str, Any]) -> list[list[str]]:
    """``addresses`` (per engine, its workers') with each group's engines replaced by the address of a relay that
    its first engine's actor runs for them (``start_relay``), where that engine stood."""
    import ray

    link = {"transport": opts["transport"], "host": opts["host"], "timeout": float(opts["timeout"]),
            "canary": bool(opts["canary"])}
    local = {**link, "transport": "shm", "host": "127.0.0.1"}
    started = {group[0]: engines[group[0]].__ray_call__.remote(start_relay, [addresses[i] for i in group], link, local)
               for group in groups}
    relays = dict(zip(started, ray.get(list(started.values()), timeout=float(opts["timeout"]))))
    behind = {i for group in groups for i in group[1:]}
    return [[relays[i]] if i in relays else addresses[i] for i in range(len(engines)) if i not in behind]


def _my_parts(trainer: Any, rank: int, world: int) -> dict[str, Any]:
    """This rank's flat part of every parameter where it lives (``flat_partitions``' buffers of ``rank``): the writer
    copies device memory into host buffers it allocates once."""
    parts = {}
    for name, param, lora in _params(trainer):
        numel = int(getattr(param, "ds_numel", param.numel()))
        size = -(-numel // world)
        lo, hi = min(rank * size, numel), min((rank + 1) * size, numel)
        if hi <= lo:
            continue
        if hasattr(param, "ds_tensor"):  # ZeRO-3: this rank's partition, padded to ``size``: no gather
            flat = param.ds_tensor.detach().reshape(-1)[: hi - lo]
        elif lora is not None:  # a LoRA actor: this part of the merged weight (PEFT's own delta: B @ A times scaling)
            with torch.no_grad():
                flat = (param.detach() + lora.get_delta_weight(lora.active_adapters[0]).to(param.dtype)).reshape(-1)[lo:hi]
        else:  # ZeRO-1/2: the whole parameter is here; send one part of it
            flat = param.detach().reshape(-1)[lo:hi]
        parts[name] = flat
    return parts


@cache
def _say_unchecked(why: str) -> None:
    logging.getLogger("rlsync").warning("rlsync: the canary is not checked in this run: %s", why)


def _canary_checked(trainer: Any, opts: dict[str, Any]) -> bool:
    """Whether the engines can run the canary's prompts while OpenRLHF syncs (the same answer on every rank)."""
    if not opts["canary"]:
        return False
    args = trainer.strategy.args
    if getattr(args.vllm, "enable_sleep", False):
        _say_unchecked("--vllm.enable_sleep keeps the engines' KV cache asleep during the sync")
        return False
    if getattr(args.train, "async_enable", False) and getattr(args.train, "partial_rollout_enable", False):
        _say_unchecked("--train.partial_rollout_enable pauses the engines during the sync")
        return False
    return True


def _check_canary(engines: list[Any], canary: Canary) -> float:
    """Rank 0, every engine holding the new version: its prompt log-probs of the canary against the trainer's; then
    every engine keeps the version, or (any deviating) every engine undoes it. Returns the largest mean deviation."""
    import ray

    params = canary_sampling_params()
    refused: str | None = None
    deviation = 0.0
    try:
        ray.get([engine.reset_prefix_cache.remote() for engine in engines])  # the canary runs on the new weights
        for i, engine in enumerate(engines):
            outputs = ray.get([engine.generate.remote(list(t), params) for t in canary.tokens])
            deviation = max(deviation, canary.check(prompt_logprobs_of(outputs, canary.tokens),
                                                    where=f"OpenRLHF's vLLM engine {i}"))
    except Exception as exc:  # noqa: BLE001  # any failure of the check refuses the version, with its reason
        refused = str(exc)
    ray.get([engine.update_weight.remote(SETTLE, dtype=refused, shape=[deviation]) for engine in engines])
    return deviation


def broadcast_to_vllm(self: Any) -> None:
    """Every rank: make the current weights live on every engine as the next version."""
    import ray
    import torch.distributed as dist

    opts = _options()
    rank, world = dist.get_rank(), dist.get_world_size()
    if getattr(self, "_rlsync_writers", None) is None:
        # rank 0 hands each rank its own credential for every reader (rank_address): a rank cannot speak for another
        addresses = getattr(self, "_rlsync_addresses", None)
        own = [None if addresses is None else [[rank_address(a, r) if split_address(a)[1] else a for a in engine]
                                               for engine in addresses] for r in range(world)] if rank == 0 else None
        box: list[Any] = [None]
        dist.scatter_object_list(box, own, src=0)
        if box[0] is None:
            raise ConfigError("rlsync's weight sync was not initialised on trainer rank 0 (no vLLM engines?)")
        src = flat_partitions([_meta(n, p) for n, p, _ in _params(self)], world)
        options = SyncOptions(transport=opts["transport"], timeout=float(opts["timeout"]), wire=opts.get("wire", "full"),
                              canary=bool(opts["canary"]))
        self._rlsync_writers = [WeightsWriter(src, None, rank, engine, options=options)
                                for engine in box[0]]
        self._rlsync_version = max(1, *(w.next_version for w in self._rlsync_writers)) - 1
    version = self._rlsync_version + 1
    started = time.perf_counter()
    # every rank: a collective forward under ZeRO-3, as OpenRLHF's own forwards are
    canary = Canary.of(self.actor.model.module) if _canary_checked(self, opts) else None
    refs = []
    if rank == 0:  # the engines wait for the version's bytes, then load it all at once (and hold it for the canary)
        refs = [engine.update_weight.remote(APPLY, dtype=None, shape=[version, float(opts["timeout"]), canary is not None])
                for engine in self.vllm_engines]
    parts = _my_parts(self, rank, world)
    for writer in self._rlsync_writers:
        writer.multi_put(parts)
    deviation = None
    with ThreadPoolExecutor(len(self._rlsync_writers)) as pool:
        completed = [pool.submit(w.complete, version, canary=canary) for w in self._rlsync_writers]
        try:
            if rank == 0:
                ray.get(refs)  # loaded (and held: the writers' complete() waits for the canary's verdict)
                if canary is not None:
                    deviation = _check_canary(self.vllm_engines, canary)
            for done in completed:
                done.result()  # CanaryError on every rank when the engines undid the version
        finally:
            if rank == 0 and getattr(self.strategy.args.vllm, "enable_prefix_caching", False):
                ray.get([engine.reset_prefix_cache.remote() for engine in self.vllm_engines])
    if rank == 0:
        ray.get(clock().set.remote(version, deviation))  # what the samples generated from now on are stamped with
        sent = sum(w.last_bytes for w in self._rlsync_writers)
        checked = "" if deviation is None else f"; canary deviation {deviation:.4f}"
        what = "adapter version" if _adapter_only(self.actor.model.module) else "version"
        relays = getattr(self, "_rlsync_relays", 0)
        through = f" ({relays} host(s) through a node relay)" if relays else ""
        print(f"rlsync: {what} {version} live on {len(self.vllm_engines)} vLLM engine(s){through}; rank 0 sent {sent / 1e6:.1f} MB "
              f"of {world} ranks' shares in {time.perf_counter() - started:.2f} s{checked}", flush=True)
    self._rlsync_version = version
    dist.barrier()
