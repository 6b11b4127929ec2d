"""LoRA adapter-only sync into vLLM: the trainer sends the adapter's A/B matrices, never the base
model, and vLLM serves each version as an adapter of its own, built in memory (no merge, no disk).

Engine side (``LLM(..., enable_lora=True, max_lora_rank=R, worker_extension_cls=
"rlsync.adapters.vllm.RlsyncWorkerExtension")``)::

    addresses = llm.collective_rpc("rlsync_lora_start", args=(tensors, peft_config, keep))
    # the trainer: WeightsWriter(from_state_dict(adapter), None, 0, addresses) ... complete(v)
    request = apply_next_lora(llm)          # a LoRARequest for version v
    llm.generate(prompts, params, lora_request=request)

Each worker's receiver stages a version (whole adapter tensors: vLLM's LoRA layers slice them for
their tensor-parallel rank), then, in the engine thread, builds vLLM's ``LoRAModel`` from them the
way vLLM's own loader does from a checkpoint directory and registers it under adapter id
``LORA_ID_BASE + version``. The newest ``keep`` versions stay registered, so requests may pick an
older one until it is dropped. A version that fails to build is refused (the trainer's ``complete``
raises) and the registered ones keep serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlsync import DEFAULT_TIMEOUT, ConfigError, StagedReceiver, SyncOptions, VersionError

#: adapter ids of synced versions: far above ids users give their own adapters
LORA_ID_BASE = 1_000_000_000
#: the ``lora_path`` of a synced version: no such directory, so vLLM never loads one from disk by mistake
LORA_PATH = "rlsync-lora://{name}/{version}"


class LoraReceiver:
    """One worker's receiver of adapter versions (see the module docstring)."""

    def __init__(self, worker: Any, tensors: Sequence[Sequence[Any]], peft_config: Mapping[str, Any], *, keep: int = 1,
                 options: SyncOptions | None = None) -> None:
        from vllm.distributed.parallel_state import get_world_group
        from vllm.lora.peft_helper import PEFTHelper

        manager = getattr(worker.model_runner, "lora_manager", None)
        if manager is None:
            raise ConfigError("this vLLM engine serves no LoRA adapters: start it with enable_lora=True and "
                              "max_lora_rank at least the adapter's rank (--enable-lora --max-lora-rank R)")
        self._manager = manager
        self.peft = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        try:
            self.peft.validate_legal(manager.lora_config)
        except ValueError as exc:
            raise ConfigError(f"vLLM cannot serve this adapter: {exc}") from None
        capacity = manager._adapter_manager.capacity
        if not 1 <= keep <= capacity:
            raise ConfigError(f"keep={keep} adapter versions, but this engine holds at most {capacity} adapters: "
                              f"raise max_cpu_loras (--max-cpu-loras) or keep fewer")
        self.keep = keep
        self.versions: list[int] = []  # registered, oldest first
        world = get_world_group().world_size
        whole = {str(name): [[0] * len(shape), list(shape)] for name, _, shape in tensors}
        self._staged = StagedReceiver(tensors, boxes=[whole] * world, rank=worker.rank, options=options)

    @property
    def address(self) -> str:
        return self._staged.address

    def apply_next(self, timeout: float) -> int:
        """Engine thread: register the next landed version as an adapter; returns its version."""
        version, views, finish = self._staged.next(timeout)
        try:
            lora = self._build(version, {name: t.clone() for name, t in views})  # the staging slot takes the next version
            adapters = self._manager._adapter_manager
            if version in self.versions:  # the same version again (a resend): it replaces the registered one
                self.versions.remove(version)
                adapters.remove_adapter(LORA_ID_BASE + version)
            while len(self.versions) >= self.keep:  # room for this one among the newest `keep`
                adapters.remove_adapter(LORA_ID_BASE + self.versions.pop(0))
            if len(adapters) + 1 > adapters.capacity:
                adapters.remove_oldest_adapter()  # vLLM's own LRU rule, as its loader does
            adapters.add_adapter(lora)
        except Exception as exc:
            finish(exc)  # the writer's complete() raises it; the registered versions keep serving
            raise
        finish(None)
        self.versions.append(version)
        return version

    def _build(self, version: int, tensors: dict[str, Any]) -> Any:
        """vLLM's ``LoRAModel`` from the adapter's tensors, with the arguments its checkpoint loader uses."""
        manager = self._manager
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = manager._lora_model_cls.from_lora_tensors(
            lora_model_id=LORA_ID_BASE + version, tensors=tensors, peft_helper=self.peft, device="cpu",
            dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
            weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        if not lora.loras:
            raise ConfigError(f"version {version}: none of the adapter's tensors names a module this model has "
                              f"(e.g. {next(iter(tensors), None)!r}); send the PEFT state dict (rlsync.wire.lora_state)")
        return lora

    def close(self) -> None:
        self._staged.close()


def apply_next_lora(llm: Any, name: str = "policy", timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Driver side: every worker registers the next adapter version that has fully landed; returns the
    ``LoRARequest`` that serves it (``llm.generate(..., lora_request=...)``). Call it between ``generate``
    calls; raises if none arrives within ``timeout`` (the registered versions keep serving)."""
    from vllm.lora.request import LoRARequest

    versions = llm.collective_rpc("rlsync_lora_apply", args=(timeout,))
    if len(set(versions)) != 1:
        raise VersionError(f"vLLM workers registered different adapter versions {versions}: restart the update")
    version = int(versions[0])
    return LoRARequest(f"{name}@{version}", LORA_ID_BASE + version, LORA_PATH.format(name=name, version=version))
