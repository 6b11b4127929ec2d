"""Fixtures of the TRL adapter tests (helpers in trl_helpers.py, importable from the tests)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
pytest.importorskip("vllm")
sys.path.insert(0, str(Path(__file__).parent))

from trl_helpers import example  # noqa: E402


@pytest.fixture(autouse=True)
def vllm_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the fresh engines run in this process
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    example.build_tokenizer(tmp_path / "tokenizer")
    return tmp_path / "tokenizer"


@pytest.fixture
def model_dir(tmp_path: Path, tokenizer_dir: Path) -> Path:
    from transformers import PreTrainedTokenizerFast

    where = tmp_path / "model"
    # wide weights: greedy output follows every change
    example.build_model(where, PreTrainedTokenizerFast.from_pretrained(tokenizer_dir), init_std=0.2)
    return where


@pytest.fixture
def server(model_dir: Path, tokenizer_dir: Path, tmp_path: Path) -> Iterator[Any]:
    """A fresh server, for the tests about one (TRL's async trainer counts versions from a fresh server's 0)."""
    running = example.Server(model_dir, tokenizer_dir, tmp_path / "server.log")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def grpo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's model and tokenizer (beside it), once for the session: the tests only read them."""
    from transformers import PreTrainedTokenizerFast

    where = tmp_path_factory.mktemp("grpo")
    example.build_tokenizer(where / "tokenizer")
    example.build_model(where / "model", PreTrainedTokenizerFast.from_pretrained(where / "tokenizer"), init_std=0.2)
    return where / "model"


@pytest.fixture(scope="session")
def grpo_server(grpo_model_dir: Path) -> Iterator[Any]:
    """One server of ``grpo_model_dir`` for the GRPOTrainer tests (a server start is most of such a test's cost).
    Each test's trainer syncs its weights before it first generates (TRL's first sync is at step 0), so a test finds
    the model's weights whatever the one before left, and a new client's versions go on from the server's live one. What differs
    from a fresh server: its sampler's random state (the completions a step samples, not their versions)."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the per-test servers run (vllm_env)
        running = example.Server(grpo_model_dir, grpo_model_dir.parent / "tokenizer", grpo_model_dir.parent / "server.log")
    yield running
    running.stop()


