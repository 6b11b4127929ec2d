"""Fixtures of the vLLM tests: every test gets a private vLLM environment; ``cleanup`` stops the receivers of
the engines a test holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def vllm_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


@pytest.fixture
def cleanup() -> Iterator[list[object]]:
    held: list[object] = []
    yield held
    for llm in held:
        try:
            llm.collective_rpc("rlsync_stop")  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an engine that failed its test may have no receiver
            pass


@pytest.fixture(autouse=True)
def vllm_global_state() -> Iterator[None]:
    """Tests share one process: what an in-process engine leaves in vLLM's globals (its parallel state, the
    distributed environment, the env cache) is cleared after each test, as vLLM's own test suite does."""
    yield
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        return
    cleanup_dist_env_and_memory()
