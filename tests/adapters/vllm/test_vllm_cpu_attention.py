"""vLLM-CPU's attention on CPUs that report AMX: ``rlsync doctor`` tries a bf16 generate and, where vLLM's AMX
kernel dies, names ``RLSYNC_VLLM_CPU_ATTENTION=vec``; with it set, rlsync's vLLM plugin holds the kernel there
and the generate runs. On CPUs without AMX, vLLM never picks that kernel and the doctor has nothing to try."""

from __future__ import annotations

import pytest
import torch

from rlsync._doctor import cpu_attention


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU reports no AMX tiles: vLLM never picks its AMX attention")
def test_the_doctor_names_the_fix_where_vllms_amx_attention_dies_and_the_fix_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLSYNC_VLLM_CPU_ATTENTION", raising=False)
    verdict = cpu_attention()  # vLLM's own choice: on this project's AMX machines, SIGILL
    if verdict is not None:
        assert "SIGILL" in verdict and "RLSYNC_VLLM_CPU_ATTENTION=vec" in verdict, verdict
    monkeypatch.setenv("RLSYNC_VLLM_CPU_ATTENTION", "vec")
    assert cpu_attention() is None  # held to the AVX-512 kernel: the same generate runs


def test_without_amx_there_is_nothing_to_try(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert cpu_attention() is None


def test_a_typo_in_the_variable_is_an_error_that_names_it() -> None:
    from rlsync import ConfigError
    from rlsync.adapters.vllm import hold_cpu_attention

    with pytest.raises(ConfigError, match="RLSYNC_VLLM_CPU_ATTENTION='amx512'.*'vec'"):
        hold_cpu_attention("amx512")
