"""vLLM with tensor parallelism 2 (two CPU workers): rlsync learns from vLLM's loader which part of each
checkpoint tensor each worker reads, sends each worker only that part, and the engine then generates
like a fresh engine with the new weights. Through the worker extension here; vLLM's native weight-transfer API at
TP=2 is tested by verl's engine route (tests/frameworks/verl/test_verl_backend.py -k straight: a single k/v head
replicated on both workers, greedy equal to a fresh TP=2 engine) and by examples/megatron_sync.py
(tests/adapters/megatron/test_megatron_vllm.py: each rank's shards into the workers' slices)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rlsync import reader_layout
from rlsync.adapters.vllm import apply_next_version, engine_layout

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two vLLM CPU workers need two cores")]

from _support import vllm_engines as common  # noqa: E402


@pytest.fixture(autouse=True)
def vllm_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # else: "Not enough allowed NUMA nodes to bind threads"
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("RLSYNC_CACHE_DIR", str(tmp_path / "cache"))


def tp2_engine(model_dir: Path):  # type: ignore[no-untyped-def]
    from vllm import LLM

    hook = {"worker_extension_cls": "rlsync.adapters.vllm.RlsyncWorkerExtension"}
    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
               tensor_parallel_size=2, max_model_len=128, seed=0, **hook)


class Extension:
    """The worker-extension route: rlsync_probe / rlsync_start / rlsync_apply."""

    def __init__(self, llm, tensors) -> None:  # type: ignore[no-untyped-def]
        self.llm, self.tensors = llm, tensors

    def probe(self):  # type: ignore[no-untyped-def]
        return self.llm.collective_rpc("rlsync_probe", args=(self.tensors,))

    def start(self, boxes):  # type: ignore[no-untyped-def]
        return self.llm.collective_rpc("rlsync_start", args=(self.tensors, boxes))

    def apply(self, version: int) -> None:
        assert apply_next_version(self.llm, 120.0) == version
        assert self.llm.collective_rpc("rlsync_version") == [version, version]

    def stop(self) -> None:
        self.llm.collective_rpc("rlsync_stop")


def shut_down(llm) -> None:  # type: ignore[no-untyped-def]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def test_two_workers_receive_their_own_parts_and_generate_like_a_fresh_engine(tmp_path: Path) -> None:
    seeds = [101, 102, 103]
    llm = tp2_engine(common.save("qwen2", 100, tmp_path / "v0"))
    tensors = common.trainer.tensors(common.trainer.build("qwen2", 100))
    sync = Extension(llm, tensors)
    boxes = sync.probe()
    # learned from vLLM's own loader: q/gate/up rows and o/down columns split in two, the single
    # key/value head replicated on both workers, norms whole on both
    q, o, k = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
               "model.layers.0.self_attn.k_proj.weight")
    assert [b[q] for b in boxes] == [[[0, 0], [64, 128]], [[64, 0], [64, 128]]]
    assert [b[o] for b in boxes] == [[[0, 0], [128, 64]], [[0, 64], [128, 64]]]
    assert [b[k] for b in boxes] == [[[0, 0], [64, 128]], [[0, 0], [64, 128]]]
    assert [b["model.norm.weight"] for b in boxes] == [[[0], [128]], [[0], [128]]]
    layout = engine_layout(tensors, boxes)
    whole = sum(t.nbytes for t in layout.tensors)
    per_rank = [sum(2 * s.box.numel for s in layout.shards if s.rank == r) for r in (0, 1)]
    assert all(0.5 * whole < n < 0.75 * whole for n in per_rank), (per_rank, whole)  # about half each, not all
    staged = [sum(b.numel * (1 if b.dtype == "uint8" else 2) for b in layout.buffers if b.rank == r) for r in (0, 1)]
    assert all(n < whole for n in staged), (staged, whole)  # each worker stores its part, not the whole model

    addresses = sync.start(boxes)
    assert reader_layout(addresses[0]) == layout  # what the trainer learns from the engine
    checked = ["--canary"]  # each version's canary, checked across both workers
    child = subprocess.Popen([sys.executable, str(common.TRAINER), "--arch", "qwen2", "--address", *addresses, *checked,
                              "--seeds", *map(str, seeds)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = {}
    try:
        for version in (1, 2, 3):
            sync.apply(version)
            llm.reset_prefix_cache()
            outputs[version] = common.generate(llm)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        if checked:  # held on both workers, checked once by the driver, settled on both
            reports = [json.loads(line) for line in out.splitlines()]
            assert [r.get("completed") for r in reports] == [1, 2, 3]
            assert all(0 < r["canary_deviation"] < 0.05 for r in reports), reports
    finally:
        if child.poll() is None:
            child.kill()
        sync.stop()
    assert len({json.dumps(o) for o in outputs.values()}) > 1
    shut_down(llm)
    assert _fresh_greedy(seeds[-1], tmp_path / "v3") == outputs[3]


def _fresh_greedy(seed: int, where: Path) -> list[list[int]]:
    """A fresh TP=2 engine loaded with the weights of ``seed``: its greedy output."""
    fresh = tp2_engine(common.save("qwen2", seed, where))
    try:
        return common.generate(fresh)
    finally:
        shut_down(fresh)
