"""The trainer side of OpenRLHF with rlsync: ``ActorPPOTrainer._init_vllm_sync_group`` and
``ActorPPOTrainer.broadcast_to_vllm``, installed through ``rlsync.patches.openrlhf.apply_trainer_side``.

OpenRLHF's own sync sends every parameter from rank 0 (one Ray round trip and one NCCL broadcast per
parameter, after a ZeRO-3 gather of it). Here **every trainer rank sends its share**, each byte once into
every engine: with ZeRO-3 a rank's own partition of each parameter (``param.ds_tensor``, no gather); with
ZeRO-1/2 (every rank holds the whole parameter) rank ``r`` sends the ``r``-th of ``world`` flat parts. Each
engine worker receives only the part its loader reads (its tensor-parallel slice), and loads a version only
once all of it has landed from every rank (``rlsync.layouts.flat_partitions`` to the engine's layout).

``_init_vllm_sync_group`` (rank 0, as OpenRLHF calls it) is the handshake: the engines answer with their
workers' addresses only if their side is patched too; otherwise it fails at once, naming the side.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlsync import ConfigError, SyncOptions, TensorMeta, WeightsWriter, __version__
from rlsync.adapters.openrlhf._versions import clock
from rlsync.adapters.openrlhf._worker import APPLY, HANDSHAKE
from rlsync.layouts import flat_partitions
from rlsync.patches.openrlhf import installed_version, options

DEFAULTS: dict[str, Any] = {"transport": "shm", "host": "127.0.0.1", "timeout": 600.0}


def _options() -> dict[str, Any]:
    return {**DEFAULTS, **(options() or {})}


def _params(trainer: Any) -> list[tuple[str, Any]]:
    """The parameters OpenRLHF syncs, in its order (a VLM's frozen vision tower is left out, as OpenRLHF does)."""
    model = trainer.actor.model.module
    is_vlm = getattr(trainer.actor, "is_vlm", False)
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad or not is_vlm]


def _meta(name: str, param: Any) -> TensorMeta:
    shape = tuple(getattr(param, "ds_shape", param.shape))  # ZeRO-3 keeps the full shape in ds_shape
    return TensorMeta(name, str(param.dtype).removeprefix("torch."), tuple(int(x) for x in shape))


def init_vllm_sync_group(self: Any, backend: str) -> None:
    """Rank 0: check both sides are rlsync's and start every engine worker's reader (OpenRLHF's signature)."""
    import ray

    opts = _options()
    hello = {"rlsync": __version__, "openrlhf": installed_version(), "transport": opts["transport"],
             "host": opts["host"], "timeout": float(opts["timeout"]),
             "tensors": [[m.name, m.dtype, list(m.shape)] for m in (_meta(n, p) for n, p in _params(self))]}
    address = HANDSHAKE + json.dumps(hello)
    refs = [engine.init_process_group.remote(address, 0, 0, 0, "rlsync", backend, False) for engine in self.vllm_engines]
    try:
        answers = ray.get(refs, timeout=float(opts["timeout"]))
    except Exception as exc:
        text = str(exc)
        if HANDSHAKE in text or "rlsync" not in text:  # OpenRLHF's own WorkerWrap tried to rendezvous at our "address"
            raise ConfigError("OpenRLHF's vLLM engines are not patched by rlsync while its trainer side is: the engine "
                              "processes need rlsync installed beside vLLM (its vllm.general_plugins entry point patches "
                              "them) and the RLSYNC_OPENRLHF environment `rlsync launch openrlhf` sets") from exc
        raise
    self._rlsync_addresses = [list(a) for a in answers]  # per engine, one address per worker
    self._rlsync_version = 0


def _my_parts(trainer: Any, rank: int, world: int) -> dict[str, Any]:
    """This rank's flat part of every parameter where it lives (``flat_partitions``' buffers of ``rank``): the writer
    copies device memory into host buffers it allocates once."""
    parts = {}
    for name, param in _params(trainer):
        numel = int(getattr(param, "ds_numel", param.numel()))
        size = -(-numel // world)
        lo, hi = min(rank * size, numel), min((rank + 1) * size, numel)
        if hi <= lo:
            continue
        if hasattr(param, "ds_tensor"):  # ZeRO-3: this rank's partition, padded to ``size``: no gather
            flat = param.ds_tensor.detach().reshape(-1)[: hi - lo]
        else:  # ZeRO-1/2: the whole parameter is here; send one part of it
            flat = param.detach().reshape(-1)[lo:hi]
        parts[name] = flat
    return parts


def broadcast_to_vllm(self: Any) -> None:
    """Every rank: make the current weights live on every engine as the next version."""
    import ray
    import torch.distributed as dist

    opts = _options()
    rank, world = dist.get_rank(), dist.get_world_size()
    if getattr(self, "_rlsync_writers", None) is None:
        box = [getattr(self, "_rlsync_addresses", None)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            raise ConfigError("rlsync's weight sync was not initialised on trainer rank 0 (no vLLM engines?)")
        src = flat_partitions([_meta(n, p) for n, p in _params(self)], world)
        options = SyncOptions(transport=opts["transport"], timeout=float(opts["timeout"]), wire=opts.get("wire", "full"))
        self._rlsync_writers = [WeightsWriter(src, None, rank, engine, options=options)
                                for engine in box[0]]
        self._rlsync_version = max(1, *(w.next_version for w in self._rlsync_writers)) - 1
    version = self._rlsync_version + 1
    started = time.perf_counter()
    refs = []
    if rank == 0:  # the engines wait for the version's bytes, then load it all at once
        refs = [engine.update_weight.remote(APPLY, dtype=None, shape=[version, float(opts["timeout"])])
                for engine in self.vllm_engines]
    parts = _my_parts(self, rank, world)
    for writer in self._rlsync_writers:
        writer.multi_put(parts)
    with ThreadPoolExecutor(len(self._rlsync_writers)) as pool:
        list(pool.map(lambda w: w.complete(version), self._rlsync_writers))
    if rank == 0:
        ray.get(refs)
        ray.get(clock().set.remote(version))  # what the samples generated from now on are stamped with
        if getattr(self.strategy.args.vllm, "enable_prefix_caching", False):
            ray.get([engine.reset_prefix_cache.remote() for engine in self.vllm_engines])
        sent = sum(w.last_bytes for w in self._rlsync_writers)
        print(f"rlsync: version {version} live on {len(self.vllm_engines)} vLLM engine(s); rank 0 sent {sent / 1e6:.1f} MB "
              f"of {world} ranks' shares in {time.perf_counter() - started:.2f} s", flush=True)
    self._rlsync_version = version
    dist.barrier()
