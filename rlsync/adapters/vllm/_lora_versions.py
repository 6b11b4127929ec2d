"""Adapter versions a vLLM server keeps for vLLM's own LoRA loader: the HTTP route of LoRA adapter-only sync
(``VllmServer.publish_lora``).

A server's requests name an adapter through its OpenAI routes (``"model": "policy@3"``). The API server knows an
adapter once ``/v1/load_lora_adapter`` registered it (under an id of its own choosing), and every worker then loads
it with vLLM's loader from the adapter's ``lora_path``. Here that path is ``rlsync-lora://NAME/VERSION``, no
directory: the loader ``install_loader`` extends (``WorkerLoRAManager._load_adapter``, vLLM 0.32) builds the adapter
from the tensors this worker received for that version (``AdapterVersions``), with the request's id, the way vLLM
builds one from a checkpoint. Every other path loads as before. A version stays loadable while it is among the
newest ``keep`` (vLLM's LRU may drop an adapter and load it again later, from here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from rlsync import ConfigError
from rlsync.adapters.vllm._lora import build_lora, peft_helper

SCHEME = "rlsync-lora://"


def path_of(name: str, version: int) -> str:
    """The ``lora_path`` under which vLLM's loader finds ``name``'s ``version`` in this process."""
    return f"{SCHEME}{name}/{version}"


class AdapterVersions:
    """The adapter versions of one name that this worker received (whole tensors), newest ``keep`` of them."""

    live: ClassVar[dict[str, AdapterVersions]] = {}  # per process: what the extended loader reads

    def __init__(self, name: str, peft_config: Mapping[str, Any], keep: int) -> None:
        if keep < 1:
            raise ConfigError(f"keep={keep}: keep at least the version being served")
        self.name, self.peft_config, self.keep = name, dict(peft_config), keep
        self.tensors: dict[int, dict[str, Any]] = {}
        AdapterVersions.live[name] = self

    def add(self, version: int, tensors: dict[str, Any]) -> None:
        self.tensors[version] = tensors

    def drop(self, version: int) -> None:
        self.tensors.pop(version, None)

    def trim(self) -> None:
        """Keep the newest ``keep`` versions."""
        for version in sorted(self.tensors)[:-self.keep]:
            del self.tensors[version]

    def close(self) -> None:
        if AdapterVersions.live.get(self.name) is self:
            del AdapterVersions.live[self.name]


def install_loader() -> None:
    """Extend vLLM's LoRA loader in this (worker) process with ``rlsync-lora://`` paths; once."""
    from vllm.lora.worker_manager import WorkerLoRAManager

    original = getattr(WorkerLoRAManager, "_load_adapter", None)
    if original is None:
        raise ConfigError("this vLLM has no WorkerLoRAManager._load_adapter, which rlsync's LoRA route over HTTP extends "
                          "(written for vLLM 0.32): use the worker-extension route (rlsync_lora_start, apply_next_lora)")
    if getattr(original, "rlsync", False):
        return

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        path = str(getattr(lora_request, "lora_path", "") or "")
        if not path.startswith(SCHEME):
            return original(self, lora_request)
        return _from_versions(self, lora_request, path)

    _load_adapter.rlsync = True  # type: ignore[attr-defined]
    setattr(WorkerLoRAManager, "_load_adapter", _load_adapter)  # noqa: B010  (a method of vLLM's, replaced)


def _from_versions(manager: Any, request: Any, path: str) -> Any:
    name, _, version = path.removeprefix(SCHEME).rpartition("/")
    versions = AdapterVersions.live.get(name)
    tensors = None if versions is None or not version.isdigit() else versions.tensors.get(int(version))
    if versions is None or tensors is None:
        held = [] if versions is None else sorted(versions.tensors)
        raise ConfigError(f"adapter {name!r} version {version} is not held by this engine (it holds versions {held}): "
                          "it never arrived, or it is older than the newest `keep` versions")
    peft = peft_helper(manager, versions.peft_config)
    # a copy per load: vLLM folds the scaling into B in place, and its LRU may load the same version again later
    copies = {n: t.clone() for n, t in tensors.items()}
    return build_lora(manager, int(request.lora_int_id), copies, peft, f"{name}@{version}")
