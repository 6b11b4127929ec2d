"""The OpenAI-compatible vLLM server started with ``--weight-transfer-config '{"backend": "rlsync"}'``:
weight updates through its HTTP routes, generation equal to a fresh engine with the new weights."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(base: str, route: str, body: dict[str, Any], timeout: float = 180) -> dict[str, Any]:
    request = urllib.request.Request(base + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return dict(json.loads(response.read()))


def _completions(base: str, model: Path) -> list[list[int]]:
    got = []
    for prompt in common.PROMPTS:
        out = _post(base, "/v1/completions", {"model": str(model), "prompt": prompt, "max_tokens": common.NEW_TOKENS,
                                              "temperature": 0.0, "return_token_ids": True})
        got.append(out["choices"][0]["token_ids"])
    return got


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen2-tied", "qwen3-moe"])
def test_http_server_updates_through_its_weight_transfer_routes(arch: str, tmp_path: Path) -> None:
    seeds = list(range(301, 321))
    model = common.save(arch, 100, tmp_path / "v0")
    port = _port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
         "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "128",
         "--seed", "0", "--weight-transfer-config", json.dumps({"backend": "rlsync"})],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"vLLM server did not start: {server.stderr.read() if server.stderr else ''}") from None
                time.sleep(1)
        address = f"tcp://127.0.0.1:{_port()}"
        tensors = common.trainer.tensors(common.trainer.build(arch, 100))
        _post(base, "/init_weight_transfer_engine", {"init_info": {"address": address, "tensors": tensors}})
        child = subprocess.Popen([sys.executable, str(common.TRAINER), "--arch", arch, "--address", address,
                                  "--seeds", *map(str, seeds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        got = {}
        for version in range(1, len(seeds) + 1):
            _post(base, "/start_weight_update", {})
            _post(base, "/update_weights", {"update_info": {"version": version, "timeout": 120.0}})
            _post(base, "/finish_weight_update", {"weight_version": str(version)})
            _post(base, "/reset_prefix_cache", {})
            got[version] = _completions(base, model)
        _, err = child.communicate(timeout=120)
        assert child.returncode == 0, err
        assert len({json.dumps(g) for g in got.values()}) > 1  # the weights really changed the output
        for version in (1, 7, 20):  # a fresh engine loaded from that version's checkpoint generates the same
            fresh = common.engine(common.save(arch, seeds[version - 1], tmp_path / f"v{version}"))
            assert got[version] == common.generate(fresh), f"version {version}"
            del fresh
        if arch == "qwen2":  # adapters into a server started without LoRA: refused, naming the flags
            from rlsync import PeerLostError
            from rlsync.adapters.vllm import VllmServer

            with pytest.raises(PeerLostError, match="--enable-lora --max-lora-rank"):
                VllmServer(base).publish_lora({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                                               torch.zeros(8, 64)}, {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
            assert _completions(base, model) == got[len(seeds)]  # the server serves on, unchanged
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
