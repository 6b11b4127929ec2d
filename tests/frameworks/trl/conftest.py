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
    running = example.Server(model_dir, tokenizer_dir, tmp_path / "server.log")
    yield running
    running.stop()


