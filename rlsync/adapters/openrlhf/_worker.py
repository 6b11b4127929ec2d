"""The vLLM side of OpenRLHF with rlsync: ``RlsyncWorkerWrap`` replaces OpenRLHF's ``WorkerWrap`` (the
``worker_extension_cls`` OpenRLHF gives vLLM; see ``rlsync.patches.openrlhf``).

OpenRLHF's engine actor (``RolloutRayActor``) reaches the workers with ``collective_rpc`` through two methods,
kept with their signatures so that OpenRLHF's actor needs no change:

- ``init_process_group(master_address, ...)``: rlsync's trainer passes ``HANDSHAKE`` + JSON (tensor list,
  versions, transport) as ``master_address``; each worker checks the tensors against its loader, starts its
  reader (with ``lora`` in it: an adapter receiver, ``rlsync_lora_start``) and returns its address (``collective_rpc`` hands the list back to the trainer). An address that is
  not rlsync's means the trainer side is not patched: refused at once, naming it (OpenRLHF's own code would
  otherwise wait in an NCCL rendezvous the trainer never joins).
- ``update_weight(name, ...)``: ``name == APPLY`` loads the next landed version, all or nothing
  (``RlsyncWorkerExtension.rlsync_apply``), and checks it is the version the trainer announced (``shape[0]``);
  with ``shape[2]`` true it holds the version for the canary (the trainer then runs the canary's prompts through
  the engine actor's ``generate``); an adapter version is registered instead (``rlsync_lora_apply``) and the
  answer is its version, which the engine actor's requests name from then on; ``name == SETTLE`` ends a held version: kept (``dtype`` None, ``shape[0]`` the
  canary's deviation), or undone (``dtype``: why; the trainer's ``complete`` raises it).
"""

from __future__ import annotations

import json
from typing import Any

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from rlsync import ConfigError, VersionError, __version__
from rlsync.adapters.vllm import RlsyncWorkerExtension

HANDSHAKE = "rlsync-handshake:"  # prefix of master_address when rlsync's trainer side calls
APPLY = "rlsync:apply"  # the parameter name of update_weight that loads the next version
SETTLE = "rlsync:settle"  # ... that ends a version held for the canary


def unpatched_trainer(what: str) -> ConfigError:
    return ConfigError(f"OpenRLHF's trainer side called {what} without rlsync's handshake, but this vLLM engine is "
                       "patched by rlsync: the trainer side is not. Start the run with `rlsync launch openrlhf -- ...` "
                       "(its Ray hook patches the trainer), or run without rlsync on both sides.")


class RlsyncWorkerWrap(WorkerWrap, RlsyncWorkerExtension):  # type: ignore[misc]  # OpenRLHF is untyped
    def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                           group_name: str, backend: str = "nccl", use_ray: bool = False) -> str:
        if not str(master_address).startswith(HANDSHAKE):
            raise unpatched_trainer("init_process_group")
        hello = json.loads(str(master_address)[len(HANDSHAKE):])
        if hello["rlsync"] != __version__:
            raise ConfigError(f"rlsync versions differ: trainer side {hello['rlsync']}, vLLM side {__version__}: "
                              "install the same rlsync in both environments")
        opts = {"transport": hello["transport"], "host": hello["host"], "timeout": float(hello["timeout"]),
                "canary": bool(hello.get("canary", True))}
        try:
            if hello.get("lora") is not None:  # adapter-only: the trainer sends its LoRA adapter, registered per version
                return self.rlsync_lora_start(hello["tensors"], hello["lora"], keep=int(hello["keep"]), options=opts)
            return self.rlsync_start(hello["tensors"], options=opts)
        except ConfigError as exc:  # named as rlsync's: the trainer tells it from an engine that is not patched
            raise ConfigError(f"rlsync's engine side refused the trainer: {exc}") from exc

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> int:
        adapter = getattr(self, "_rlsync_lora", None) is not None
        if name == SETTLE:
            return (self.rlsync_lora_settle if adapter else self.rlsync_settle)(dtype, float(shape[0]))
        if name != APPLY:
            raise unpatched_trainer(f"update_weight({name!r})")
        expected, timeout, hold = int(shape[0]), float(shape[1]), len(shape) > 2 and bool(shape[2])
        version = (self.rlsync_lora_apply if adapter else self.rlsync_apply)(timeout, hold)
        if version != expected:
            raise VersionError(f"the vLLM engine loaded version {version}, the trainer announced {expected}")
        return version
