"""OpenRLHF's engine actor (``RolloutRayActor``) serving the trainer's LoRA adapter as an adapter, not merged
(installed through ``rlsync.patches.openrlhf.apply_engine_actor``).

OpenRLHF builds its vLLM engines without LoRA and generates without naming an adapter, so a LoRA actor's weights
can only reach them merged (the whole model every step). When the launcher saw ``--ds.lora.rank R`` (and
``--lora-sync adapter``, its default), the engine is built with LoRA enabled (``max_lora_rank`` the smallest vLLM
allows at or above R; room for ``max_staleness + 1`` versions and one more held for its canary), the trainer sends
the adapter's A/B matrices only, every worker registers each version as an adapter of its own
(``rlsync.adapters.vllm``'s ``rlsync_lora_*``), and every request OpenRLHF sends names the newest registered
version (``rlsync.adapters.vllm.lora_request``): a request keeps the version it started with to its end, while
newer ones load beside it.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

from rlsync import ConfigError, NodeRelay, SyncOptions, VersionError
from rlsync.adapters.openrlhf._routes import start_recording
from rlsync.adapters.openrlhf._worker import APPLY, SETTLE
from rlsync.adapters.vllm import lora_request
from rlsync.patches.openrlhf import options


def adapter_sync(opts: dict[str, Any] | None) -> bool:
    """Whether the run syncs a LoRA actor as an adapter (the launcher saw ``--ds.lora.rank`` > 0 and ``--lora-sync
    adapter``). The same answer in the trainer ranks and the engine actors: both read the launcher's options."""
    opts = opts or {}
    return int(opts.get("lora_rank") or 0) > 0 and opts.get("lora_sync", "adapter") == "adapter"


def kept_versions(opts: dict[str, Any]) -> int:
    """Adapter versions an engine keeps registered: as many as the staleness bound lets samples use."""
    return int(opts.get("max_staleness") or 0) + 1


def lora_engine_args(opts: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM engine arguments that let the engine serve the run's adapter versions (none without adapter sync)."""
    if not adapter_sync(opts):
        return {}
    assert opts is not None
    rank = int(opts["lora_rank"])
    from vllm.config.lora import MaxLoRARanks  # the ranks vLLM allows (this runs in the engine actor, beside vLLM)

    allowed = sorted(int(r) for r in typing.get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ConfigError(f"--ds.lora.rank {rank}: vLLM serves LoRA adapters up to rank {allowed[-1]}; lower the rank or "
                          "sync merged weights (rlsync launch openrlhf --lora-sync merged)")
    slots = kept_versions(opts) + 1  # the kept versions and one held beside them until its canary passed
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": slots, "max_cpu_loras": slots}


def wrap_init(original: Any) -> Any:
    """``RolloutRayActor.__init__``: with adapter sync, LoRA on in the engine and every request names the newest
    adapter version (none until the first arrives: the base model, which is the policy PEFT starts from); MoE routes
    recorded where the run replays them."""

    @functools.wraps(original)
    async def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        extra = lora_engine_args(options())
        await original(self, *args, **{**kwargs, **extra})
        await start_recording(self)  # MoE routes, for routing replay in the trainer (rlsync.adapters.openrlhf._routes)
        self._rlsync_lora = None  # the LoRARequest new requests name
        if not extra:
            return
        generate = self.llm.generate

        def generate_with_adapter(*a: Any, **kw: Any) -> Any:
            if kw.get("lora_request") is None:
                kw["lora_request"] = self._rlsync_lora
            return generate(*a, **kw)

        self.llm.generate = generate_with_adapter  # OpenRLHF's generate() calls it without an adapter

    return __init__


def wrap_update_weight(original: Any) -> Any:
    """``RolloutRayActor.update_weight``: after rlsync's apply or settle of an adapter version, new requests name the
    version the workers answered with (the held one for its canary; after a refused one, the previous again)."""

    @functools.wraps(original)
    async def update_weight(self: Any, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> Any:
        answers = await original(self, name, dtype, shape, empty_cache)
        if name in (APPLY, SETTLE) and adapter_sync(options()):
            versions = set(answers)
            if len(versions) != 1:
                raise VersionError(f"vLLM workers of one engine answered different adapter versions {sorted(versions)}")
            version = int(versions.pop())
            self._rlsync_lora = None if version < 0 else lora_request(version)
        return answers

    return update_weight


def start_relay(actor: Any, engines: list[list[str]], link: dict[str, Any], local: dict[str, Any]) -> str:
    """Run in the engine actor that leads its host (``actor.__ray_call__``): a ``NodeRelay`` for ``engines`` (their
    workers' addresses, this actor's engine first), reached over ``link`` (the trainer's transport), forwarding over
    ``local`` (shared memory); its address, for the trainer's writers. It lives as long as the actor."""
    old = getattr(actor, "_rlsync_relay", None)
    if old is not None:  # a sync group made again: its relay replaces the last one
        old.close()
    actor._rlsync_relay = None
    try:
        actor._rlsync_relay = NodeRelay(engines, options=SyncOptions.from_mapping(link, where="the node relay"),
                                        local=SyncOptions.from_mapping(local, where="the node relay"))
    except ConfigError as exc:  # no room for it, say: named with the launcher's option that does without
        raise ConfigError(f"{exc} (rlsync launch openrlhf --relay off)") from exc
    return str(actor._rlsync_relay.address)
