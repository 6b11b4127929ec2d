"""The OpenAI-compatible vLLM server started with ``--weight-transfer-config '{"backend": "rlsync"}'``:
weight updates through its HTTP routes, generation equal to a fresh engine with the new weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

from _support import vllm_engines as common  # noqa: E402
from _support import vllm_server  # noqa: E402

from rlsync.adapters.vllm import RouteCredential  # noqa: E402
from rlsync.core import with_key  # noqa: E402


# Two architectures: the routes are the same for all; what differs by architecture (the engine's loader: fused qkv,
# tied heads, MoE experts) is test_vllm_updates.py's, in process, for all four. qwen2 also carries the LoRA refusal.
@pytest.mark.parametrize("arch", ["qwen2", "qwen3-moe"])
def test_http_server_updates_through_its_weight_transfer_routes(arch: str, tmp_path: Path) -> None:
    seeds = list(range(301, 321))
    model = common.save(arch, 100, tmp_path / "v0")
    with vllm_server.running(model, tmp_path / "server.log") as base:
        # as the docs say: every request signed (the server's routes answer any HTTP client), the readers' key derived
        credential = RouteCredential()
        address = f"tcp://127.0.0.1:{common.free_port()}"
        tensors = common.trainer.tensors(common.trainer.build(arch, 100))
        vllm_server.post(base, "/init_weight_transfer_engine", {"init_info": credential.init({"address": address, "tensors": tensors})})
        child = subprocess.Popen([sys.executable, str(common.TRAINER), "--arch", arch, "--address",
                                  with_key(address, credential.reader_secret), "--seeds", *map(str, seeds)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        got = {}
        for version in range(1, len(seeds) + 1):
            vllm_server.post(base, "/start_weight_update", {})
            vllm_server.post(base, "/update_weights", {"update_info": credential.update({"version": version, "timeout": 120.0})})
            vllm_server.post(base, "/update_weights", {"update_info": credential.update({"version": version, "commit": True})})
            vllm_server.post(base, "/finish_weight_update", {"weight_version": str(version)})
            vllm_server.post(base, "/reset_prefix_cache", {})
            got[version] = vllm_server.greedy(base, str(model), common.PROMPTS, common.NEW_TOKENS)
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
            # the server serves on, unchanged
            assert vllm_server.greedy(base, str(model), common.PROMPTS, common.NEW_TOKENS) == got[len(seeds)]
