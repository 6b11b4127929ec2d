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
raises) and the registered ones keep serving. A version that comes with the trainer's canary (``rlsync.Canary`` of
its PEFT model) is registered beside the kept ones and checked first (``apply_next_lora``: the engine's prompt
log-probs with that adapter): one that deviates is removed again (``CanaryError``, here and in the trainer).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from rlsync import DEFAULT_TIMEOUT, CanaryError, ConfigError, Finish, StagedReceiver, SyncOptions, VersionError
from rlsync.adapters.vllm._driver import check_held_canary

#: adapter ids of synced versions: far above ids users give their own adapters
LORA_ID_BASE = 1_000_000_000
#: the ``lora_path`` of a synced version: no such directory, so vLLM never loads one from disk by mistake
LORA_PATH = "rlsync-lora://{name}/{version}"


class LoraReceiver:
    """One worker's receiver of adapter versions (see the module docstring)."""

    def __init__(self, worker: Any, tensors: Sequence[Sequence[Any]], peft_config: Mapping[str, Any], *, keep: int = 1,
                 options: SyncOptions | None = None) -> None:
        from vllm.distributed.parallel_state import get_world_group

        refuse_unsupported(peft_config)
        manager = getattr(worker.model_runner, "lora_manager", None)
        if manager is None:
            raise ConfigError("this vLLM engine serves no LoRA adapters: start it with enable_lora=True and "
                              "max_lora_rank at least the adapter's rank (--enable-lora --max-lora-rank R)")
        self._manager = manager
        self.peft = peft_helper(manager, peft_config)
        capacity = manager._adapter_manager.capacity
        if not 1 <= keep <= capacity:
            raise ConfigError(f"keep={keep} adapter versions, but this engine holds at most {capacity} adapters: "
                              f"raise max_cpu_loras (--max-cpu-loras) or keep fewer")
        self.keep = keep
        self.versions: list[int] = []  # registered, oldest first
        world = get_world_group().world_size
        self._staged = adapter_receiver(tensors, worker.rank, world, options)
        self._held: tuple[int, Finish] | None = None  # registered, canary not yet checked

    @property
    def address(self) -> str:
        return self._staged.address

    def apply_next(self, timeout: float, hold: bool = False) -> int:
        """Engine thread: register the next landed version as an adapter; returns its version. ``hold``: the caller
        checks the version's canary, if one came (``canary``), then calls ``settle``; until then the version is
        registered beside the kept ones and the trainer's ``complete`` waits."""
        version, views, finish = self._staged.next(timeout)
        reader = self._staged.reader
        held = hold and reader.landed_canary is not None and reader.options.canary
        try:
            lora = self._build(version, {name: t.clone() for name, t in views})  # the staging slot takes the next version
            adapters = self._manager._adapter_manager
            if version in self.versions:  # the same version again (a resend): it replaces the registered one
                self.versions.remove(version)
                adapters.remove_adapter(LORA_ID_BASE + version)
            if held and len(adapters) + 1 > adapters.capacity:
                raise ConfigError(f"a checked adapter version is held beside the {self.keep} kept one(s) until its canary "
                                  f"passed: this engine holds {adapters.capacity}; raise max_cpu_loras (--max-cpu-loras) "
                                  f"to {self.keep + 1} or more")
            while not held and len(self.versions) >= self.keep:  # room for this one among the newest `keep`
                adapters.remove_adapter(LORA_ID_BASE + self.versions.pop(0))
            if len(adapters) + 1 > adapters.capacity:
                adapters.remove_oldest_adapter()  # vLLM's own LRU rule, as its loader does
            adapters.add_adapter(lora)
        except Exception as exc:
            finish(exc)  # the writer's complete() raises it; the registered versions keep serving
            raise
        if held:
            self._held = (version, finish)
            return version
        finish(None)
        self.versions.append(version)
        return version

    def canary(self) -> dict[str, Any] | None:
        """The trainer's canary of the held version (``rlsync.Canary``'s fields), or None."""
        canary = self._staged.reader.landed_canary
        return None if self._held is None or canary is None else msgspec.structs.asdict(canary)

    def settle(self, refused: str | None, deviation: float | None) -> int:
        """End the held version: kept (the oldest beyond ``keep`` dropped) or, ``refused``, removed again (the trainer's
        ``complete`` raises ``CanaryError`` with that reason). Returns the newest registered version (-1: none)."""
        if self._held is None:
            raise ConfigError("rlsync_lora_settle: no adapter version is held (rlsync_lora_apply(timeout, hold=True) first)")
        (version, finish), self._held = self._held, None
        adapters = self._manager._adapter_manager
        if refused is not None:
            adapters.remove_adapter(LORA_ID_BASE + version)
            finish(CanaryError(refused))
            return self.versions[-1] if self.versions else -1
        while len(self.versions) >= self.keep:
            adapters.remove_adapter(LORA_ID_BASE + self.versions.pop(0))
        self._staged.reader.canary_deviation = deviation
        finish(None)
        self.versions.append(version)
        return version

    def _build(self, version: int, tensors: dict[str, Any]) -> Any:
        return build_lora(self._manager, LORA_ID_BASE + version, tensors, self.peft, f"version {version}")

    def close(self) -> None:
        self._staged.close()


def adapter_receiver(tensors: Sequence[Sequence[Any]], rank: int, world: int, options: SyncOptions | None, *,
                     live_version: int = -1) -> StagedReceiver:
    """Worker ``rank``'s receiver of adapter versions: every worker takes the whole adapter (vLLM's LoRA layers slice
    it for their tensor-parallel rank). ``live_version``: the version served when it starts (writers go on after it)."""
    whole = {str(name): [[0] * len(shape), list(shape)] for name, _, shape in tensors}
    return StagedReceiver(tensors, boxes=[whole] * world, rank=rank, options=options, live_version=live_version)


def refuse_unsupported(peft_config: Mapping[str, Any]) -> None:
    """LoRA on fused MoE expert parameters (PEFT's ``target_parameters``, e.g. ``mlp.experts.gate_up_proj``): vLLM 0.32
    reads such adapters only from a checkpoint directory in its 3D expert format, which this route does not build
    (``build_lora`` passes no expert-parallel spec). Refused by name rather than served wrong."""
    targets = peft_config.get("target_parameters") or []
    if targets:
        raise ConfigError(f"the adapter trains fused MoE expert parameters ({sorted(targets)[:3]}): rlsync's adapter-only "
                          "sync does not carry per-expert LoRA yet. Sync merged weights instead (a server or engine "
                          "started without LoRA gets them), or target the attention and dense projections only")


def peft_helper(manager: Any, peft_config: Mapping[str, Any]) -> Any:
    """vLLM's ``PEFTHelper`` of an adapter's config, checked against what the engine serves (``manager``: a worker's
    ``WorkerLoRAManager``)."""
    from vllm.lora.peft_helper import PEFTHelper

    peft = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    try:
        peft.validate_legal(manager.lora_config)
    except ValueError as exc:
        raise ConfigError(f"vLLM cannot serve this adapter: {exc}") from None
    return peft


def build_lora(manager: Any, lora_id: int, tensors: dict[str, Any], peft: Any, what: str) -> Any:
    """vLLM's ``LoRAModel`` from an adapter's tensors, with the arguments vLLM's checkpoint loader uses
    (``manager``: a worker's ``WorkerLoRAManager``; ``peft``: vLLM's ``PEFTHelper`` of the adapter's config)."""
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_id, tensors=tensors, peft_helper=peft, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    if not lora.loras:
        raise ConfigError(f"{what}: none of the adapter's tensors names a module this model has "
                          f"(e.g. {next(iter(tensors), None)!r}); send the PEFT state dict (rlsync.wire.lora_state)")
    return lora


def apply_next_lora(llm: Any, name: str = "policy", timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Driver side: every worker registers the next adapter version that has fully landed; returns the
    ``LoRARequest`` that serves it (``llm.generate(..., lora_request=...)``). Call it between ``generate``
    calls; raises if none arrives within ``timeout`` (the registered versions keep serving)."""
    versions = llm.collective_rpc("rlsync_lora_apply", args=(timeout, True))
    if len(set(versions)) != 1:
        raise VersionError(f"vLLM workers registered different adapter versions {versions}: restart the update")
    version = int(versions[0])
    request = lora_request(version, name)
    # registered, not yet settled: checked with its own adapter
    check_held_canary(llm, "rlsync_lora_canary", "rlsync_lora_settle", where="the vLLM engine's adapter", lora_request=request)
    return request


def lora_request(version: int, name: str = "policy") -> Any:
    """vLLM's ``LoRARequest`` of a synced adapter ``version`` (registered by ``rlsync_lora_apply``): what a request that
    must be answered by that version passes to ``generate``."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"{name}@{version}", LORA_ID_BASE + version, LORA_PATH.format(name=name, version=version))
