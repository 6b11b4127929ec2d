"""LoRA adapter-only sync into a stock vLLM server over HTTP (``VllmServer.publish_lora``): a PEFT adapter's A/B
matrices cross, nothing of the base model; each version is served as adapter ``policy@V`` and answers exactly as
the same server serving that adapter loaded by vLLM's own loader from PEFT's ``save_pretrained`` directory. Two
versions are served at once; older ones are unloaded; a version whose canary deviates is never served."""

from __future__ import annotations

import os
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

from rlsync import Canary, CanaryError  # noqa: E402
from rlsync.adapters.vllm import VllmServer  # noqa: E402
from rlsync.wire import lora_state  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402
from _support import vllm_server  # noqa: E402

RANK = 8


def _greedy(base: str, model: str) -> list[list[int]]:
    return vllm_server.greedy(base, model, common.PROMPTS, common.NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A vLLM server of a tiny Qwen2 with LoRA enabled and rlsync's weight-transfer backend, as a user starts it; one
    for the module's tests (each of its trainers picks up from the versions the last one left)."""
    tmp_path = tmp_path_factory.mktemp("lora-server")
    model = common.save("qwen2", 100, tmp_path / "base")
    lora = ["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2", "--max-cpu-loras", "4"]
    # the conftest's per-test environment (vllm_env) is not set yet for a module's fixture: the server's, in full
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_RPC_BASE_PATH": str(tmp_path), "TMPDIR": str(tmp_path)}
    with vllm_server.running(model, tmp_path / "server.log", lora, env=env) as base:
        yield base, model


def _trainer(arch: str = "qwen2") -> Any:
    return peft.get_peft_model(common.trainer.build(arch, 100),
                               peft.LoraConfig(r=RANK, lora_alpha=16, target_modules=["q_proj", "v_proj"]))


def _step(model: Any, seed: int) -> None:
    """A training step's worth of change, large enough that greedy output depends on the adapter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)


def test_adapter_versions_reach_a_vllm_server_without_the_base_model(lora_server: tuple[str, Path], tmp_path: Path) -> None:
    base, model = lora_server
    trainer = _trainer()
    server = VllmServer(base)
    base_greedy = _greedy(base, str(model))
    model_bytes = sum(p.numel() * 2 for p in trainer.get_base_model().parameters())  # what a bf16 full sync moves
    served: dict[str, list[list[int]]] = {}
    try:
        for version, seed in ((1, 11), (2, 12), (3, 13)):
            _step(trainer, seed)
            tensors, config = lora_state(trainer)
            stats = server.publish_lora(tensors, config, canary=Canary.of(trainer))
            assert (stats.version, stats.adapter, stats.label) == (version, f"policy@{version}", f"policy@{version}")
            assert stats.canary_deviation is not None and stats.canary_deviation < 0.05
            assert stats.bytes == sum(t.numel() * 2 for t in tensors.values()) < model_bytes / 10  # the adapter alone, bf16
            assert server.weight_version() == stats.label
            trainer.save_pretrained(tmp_path / f"adapter-v{version}")  # the reference: vLLM's loader reads it from disk
            vllm_server.post(base, "/v1/load_lora_adapter", {"lora_name": f"disk-v{version}", "lora_path": str(tmp_path / f"adapter-v{version}")})
            synced = _greedy(base, stats.adapter)
            assert synced == _greedy(base, f"disk-v{version}"), f"version {version}"
            assert synced != base_greedy
            served[stats.adapter] = synced
        assert len({str(g) for g in served.values()}) == 3
        assert _greedy(base, "policy@2") == served["policy@2"]  # keep=2: version 2 still answers beside version 3
        with pytest.raises(urllib.error.HTTPError):  # version 1 was unloaded: no request can name it
            _greedy(base, "policy@1")
        assert _greedy(base, str(model)) == base_greedy  # the base model never moved
    finally:
        server.close()


def test_an_adapter_whose_canary_deviates_is_never_served(lora_server: tuple[str, Path]) -> None:
    """The B matrices never reach the engine (sent as zeros), the canary is of the trainer's real adapter: refused,
    unloaded, and the previous version is what the server reports and serves."""
    base, _ = lora_server
    trainer = _trainer()
    server = VllmServer(base)
    try:
        _step(trainer, 11)
        tensors, config = lora_state(trainer)
        first = server.publish_lora(tensors, config, canary=Canary.of(trainer))
        before = _greedy(base, first.adapter)
        _step(trainer, 12)
        tensors, _ = lora_state(trainer)
        lost = {n: torch.zeros_like(t) if ".lora_B." in n else t for n, t in tensors.items()}
        with pytest.raises(CanaryError, match="deviate"):
            server.publish_lora(lost, config, canary=Canary.of(trainer))
        assert server.weight_version() == first.label
        assert _greedy(base, first.adapter) == before
        refused = f"policy@{first.version + 1}"
        with pytest.raises(urllib.error.HTTPError):
            _greedy(base, refused)
        third = server.publish_lora(tensors, config, canary=Canary.of(trainer))  # the same step, delivered whole
        assert third.adapter == refused and third.canary_deviation is not None and third.canary_deviation < 0.05
    finally:
        server.close()


@pytest.fixture
def tied_lora_server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """As ``lora_server``, of a tied Qwen3 (the model the canary crashed vLLM's engine with)."""
    model = common.save("qwen3-tied", 100, tmp_path / "base")
    lora = ["--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2", "--max-cpu-loras", "4"]
    with vllm_server.running(model, tmp_path / "server.log", lora,
                             env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}) as base:
        yield base, model


def test_the_canary_of_an_adapter_never_crashes_the_engine_it_checks(tied_lora_server: tuple[str, Path]) -> None:
    """Issue #66, item 15: vLLM computes prompt log-probs with a LoRA adapter on the wrong LoRA mapping when its batch
    holds more than one request (vLLM issues 16668 and 29955: ``einsum(): subscript b has size 2 ... size 15`` in the
    LoRA logits path, and the engine core dead for the rest of the run). Before, the adapter's canary asked prompt
    log-probs for all its rows in one request, and rollouts with the adapter ran beside it: versions published while
    requests are in flight, repeated, must all be checked and the server must serve on."""
    import threading

    base, _ = tied_lora_server
    trainer = _trainer("qwen3-tied")
    server = VllmServer(base)
    stop = threading.Event()
    failures: list[BaseException] = []

    def rollouts() -> None:  # requests with the newest adapter, all the time, as a trainer's rollouts are
        while not stop.is_set():
            try:
                if server.version:
                    vllm_server.post(base, "/v1/completions", {"model": f"policy@{server.version}", "prompt": [
                        [5, 17, 42, 99, 3], [200, 1, 77]], "max_tokens": 4, "temperature": 1.0})
            except urllib.error.HTTPError as exc:  # an adapter unloaded in between: fine; a dead engine is not
                if exc.code >= 500:
                    failures.append(exc)
            except Exception as exc:  # noqa: BLE001 - the engine gone
                failures.append(exc)

    thread = threading.Thread(target=rollouts, daemon=True)
    thread.start()
    try:
        for seed in range(21, 27):
            _step(trainer, seed)
            tensors, config = lora_state(trainer)
            stats = server.publish_lora(tensors, config, canary=Canary.of(trainer))
            assert stats.canary_deviation is not None and stats.canary_deviation < 0.05, stats
        stop.set()
        thread.join(30)
        assert not failures, failures[:2]
        vllm_server.post(base, "/v1/completions", {"model": stats.adapter, "prompt": [1, 2], "max_tokens": 1})  # it serves on
    finally:
        stop.set()
        server.close()
