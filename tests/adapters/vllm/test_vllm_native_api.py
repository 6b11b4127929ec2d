"""vLLM's own weight-transfer API with ``{"backend": "rlsync"}`` (registered by rlsync's
``vllm.general_plugins`` entry point): the trainer pushes from another process, the driver calls
start/update/finish, and greedy output equals a fresh engine loaded with the new weights."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

# vLLM itself raises deprecation and future warnings on import and at start-up: not ours to fix.
pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402


def test_native_weight_transfer_api_with_the_rlsync_backend(tmp_path: Path) -> None:
    from vllm import LLM

    llm = LLM(model=str(common.save("qwen2", 100, tmp_path / "v0")), skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", distributed_executor_backend="uni", max_model_len=128, seed=0,
              weight_transfer_config={"backend": "rlsync"})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
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
