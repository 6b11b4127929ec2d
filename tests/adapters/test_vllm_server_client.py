"""``rlsync.adapters.vllm.VllmServer`` refuses a server it cannot sync, naming the flag to set.

The server here is a FAKE of vLLM 0.32's HTTP API, two routes only: ``GET /server_info?config_format=json``
answers ``{"vllm_config": {...}}`` as ``vllm/entrypoints/serve/dev/server_info`` does (``weight_transfer_config``
is ``null`` without ``--weight-transfer-config``), and every route a server started without
``VLLM_SERVER_DEV_MODE=1`` lacks answers 404. The real server is driven in tests/frameworks/trl."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rlsync import ConfigError, PeerLostError
from rlsync.adapters.vllm import VllmServer, reserve_ports


def _fake_vllm(weight_transfer: dict[str, Any] | None, dev_mode: bool) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.startswith("/server_info") and dev_mode:
                body = json.dumps({"vllm_config": {"weight_transfer_config": weight_transfer,
                                                   "model_config": {"dtype": "torch.bfloat16"}}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_error(404)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def fake() -> Iterator[list[ThreadingHTTPServer]]:
    started: list[ThreadingHTTPServer] = []
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("transfer", "dev_mode", "match"), [
    ({"backend": "nccl"}, True, "backend 'nccl', not rlsync's: start it as VLLM_SERVER_DEV_MODE=1"),
    (None, True, "backend None, not rlsync's"),
    ({"backend": "rlsync"}, False, "has no route /server_info.*VLLM_SERVER_DEV_MODE=1"),
])
def test_a_server_rlsync_cannot_sync_is_named_with_the_fix(fake: list[ThreadingHTTPServer], transfer: Any, dev_mode: bool, match: str) -> None:
    fake.append(_fake_vllm(transfer, dev_mode))
    server = VllmServer(f"http://127.0.0.1:{fake[0].server_address[1]}")
    with pytest.raises(ConfigError, match=match):
        server.config()
    with pytest.raises(ConfigError, match=match):  # publishing asks first: no tensor is read, nothing is sent
        server.publish(iter([]))


def test_the_server_of_rlsync_is_accepted_and_an_absent_one_is_a_lost_peer(fake: list[ThreadingHTTPServer]) -> None:
    fake.append(_fake_vllm({"backend": "rlsync"}, True))
    assert VllmServer(f"http://localhost:{fake[0].server_address[1]}").config()["model_config"]["dtype"] == "torch.bfloat16"
    gone = VllmServer(f"http://127.0.0.1:{reserve_ports('127.0.0.1', 1)}")
    with pytest.raises(PeerLostError, match="did not answer /health within 1 s"):
        gone.wait_ready(timeout=1)


def test_reserved_ports_are_consecutive_and_free() -> None:
    import socket

    base = reserve_ports("127.0.0.1", 4)
    held = []
    for port in range(base, base + 4):
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        held.append(s)
    for s in held:
        s.close()


def test_per_expert_lora_is_refused_by_name_before_anything_is_sent() -> None:
    """PEFT LoRA on fused MoE expert parameters (``target_parameters``): not carried by the adapter route (vLLM 0.32
    reads that 3D format only from a checkpoint), refused before the server is even asked."""
    import torch

    from rlsync import ConfigError

    server = VllmServer(f"http://127.0.0.1:{reserve_ports('127.0.0.1', 1)}")  # nothing listens: no request is made
    with pytest.raises(ConfigError, match="per-expert LoRA"):
        server.publish_lora({"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.zeros(8, 16)},
                            {"r": 8, "target_modules": [], "target_parameters": ["mlp.experts.gate_up_proj"]})


@pytest.mark.parametrize(("label", "version"), [("default", 0), ("7", 7), ("12+00ab34cd56ef7890", 12),
                                                 ("policy@3", 3), ("policy@4+00ab34cd56ef7890", 4)])
def test_a_servers_weight_version_label_reads_as_its_version(label: str, version: int) -> None:
    from rlsync.adapters.vllm import label_version

    assert label_version(label) == version


def test_a_label_rlsync_did_not_set_is_refused_by_name() -> None:
    from rlsync import VersionError
    from rlsync.adapters.vllm import label_version

    with pytest.raises(VersionError, match="'step-10' is not one of rlsync's"):
        label_version("step-10")
