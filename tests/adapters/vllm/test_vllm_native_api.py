"""vLLM's own weight-transfer API with ``{"backend": "rlsync"}`` (registered by rlsync's
``vllm.general_plugins`` entry point): the trainer pushes from another process, the driver calls
start/update/finish, and greedy output equals a fresh engine loaded with the new weights."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlsync.core import keyed  # noqa: E402

pytest.importorskip("vllm")

# vLLM itself raises deprecation and future warnings on import and at start-up: not ours to fix.
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402


def native_engine(model_dir: Path) -> Any:
    """An in-process engine whose weight-transfer backend is rlsync's (vLLM's own API)."""
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
               distributed_executor_backend="uni", max_model_len=128, seed=0, weight_transfer_config={"backend": "rlsync"})


def test_native_weight_transfer_api_with_the_rlsync_backend(tmp_path: Path) -> None:

    llm = native_engine(common.save("qwen2", 100, tmp_path / "v0"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = keyed(f"tcp://127.0.0.1:{s.getsockname()[1]}")  # the address with a fresh key
    llm.init_weight_transfer_engine({"init_info": {"address": address, "tensors": common.trainer.tensors(common.trainer.build("qwen2", 100))}})
    seeds = [201, 202, 203]
    child = subprocess.Popen([sys.executable, str(common.TRAINER), "--arch", "qwen2", "--address", address,
                              "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = {}
    try:
        for version in (1, 2, 3):
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version, "timeout": 120.0}})
            llm.finish_weight_update(weight_version=str(version))
            llm.reset_prefix_cache()
            outputs[version] = common.generate(llm)
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert [json.loads(line)["completed"] for line in out.splitlines()] == [1, 2, 3]
    finally:
        if child.poll() is None:
            child.kill()
    assert llm.get_weight_version() == "3"
    fresh = common.engine(common.save("qwen2", seeds[-1], tmp_path / "v3"))
    assert common.generate(fresh) == outputs[3]


@pytest.mark.parametrize("arch", ["gemma2-tied", "gemma3-tied"])
def test_a_tied_model_syncs_from_its_state_dict(arch: str, tmp_path: Path) -> None:
    """The trainer offers and sends ``state_dict()`` as it is, its tied ``lm_head.weight`` included; vLLM's Gemma2
    has no lm_head (its loader refuses the name), Gemma3's ties one: both leave the alias out, never refuse it."""

    llm = native_engine(common.save(arch, 100, tmp_path / "v0"))
    tensors = common.trainer.tensors(common.trainer.build(arch, 100), state_dict=True)
    assert "lm_head.weight" in [t[0] for t in tensors]
    address = keyed(f"tcp://127.0.0.1:{common.free_port()}")
    llm.init_weight_transfer_engine({"init_info": {"address": address, "tensors": tensors}})
    seeds = [201, 202, 203]
    child = subprocess.Popen([sys.executable, str(common.TRAINER), "--arch", arch, "--address", address, "--state-dict",
                              "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = []
    try:
        for version in (1, 2, 3):
            llm.start_weight_update()
            llm.update_weights({"update_info": {"version": version, "timeout": 120.0}})
            llm.finish_weight_update(weight_version=str(version))
            llm.reset_prefix_cache()
            outputs.append(common.generate(llm))
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
    finally:
        if child.poll() is None:
            child.kill()
    for version, seed in enumerate(seeds):
        fresh = common.engine(common.save(arch, seed, tmp_path / f"v{version + 1}"))
        assert common.generate(fresh) == outputs[version], f"version {version + 1}"
        del fresh
    assert len({str(o) for o in outputs}) == 3  # each version changed what the engine generates


def test_a_writer_the_engine_refuses_fails_the_engines_update_at_once(tmp_path: Path) -> None:
    """A trainer that builds the destination layout itself (``engine_layout``) from a tied Qwen3's ``state_dict()``
    holds ``lm_head.weight``, which the engine leaves out: refused at connect, and the engine's pending update fails
    within a second with the same reason (not after its timeout); the engine keeps serving the weights it had."""
    import threading
    import time

    from rlsync import SyncOptions, WeightMismatchError, WeightsWriter
    from rlsync.layouts import engine_layout, from_state_dict

    llm = native_engine(common.save("qwen3-tied", 100, tmp_path / "v0"))
    before = common.generate(llm)
    model = common.trainer.build("qwen3-tied", 7)
    state = {name: t.detach() for name, t in model.state_dict().items()}
    tensors = common.trainer.tensors(model, state_dict=True)
    address = keyed(f"tcp://127.0.0.1:{common.free_port()}")
    llm.init_weight_transfer_engine({"init_info": {"address": address, "tensors": tensors}})
    writer = WeightsWriter(from_state_dict(state), engine_layout(tensors), 0, [address], options=SyncOptions(timeout=300))
    writer.multi_put(state)
    trainer_error: list[BaseException] = []

    def send() -> None:
        try:
            writer.complete(1)
        except BaseException as exc:  # noqa: BLE001 - read below
            trainer_error.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    llm.start_weight_update()
    started = time.monotonic()
    with pytest.raises(Exception, match=r"'lm_head.weight' is in the writer's and not in the engine's") as engine_error:
        llm.update_weights({"update_info": {"version": 1, "timeout": 300.0}})
    assert time.monotonic() - started < 1.5
    sender.join(30)
    assert isinstance(trainer_error[0], WeightMismatchError) and "WeightsWriter with dst=None" in str(trainer_error[0])
    assert str(trainer_error[0]).split("refused: ", 1)[1] in str(engine_error.value)  # the same reason, both sides
    writer.close()
    llm.reset_prefix_cache()
    assert common.generate(llm) == before
