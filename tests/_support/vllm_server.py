"""A stock vLLM OpenAI server for the tests, started as a user starts it (rlsync's weight-transfer backend, loopback),
and plain JSON requests to it. Imports nothing of vLLM: the verl tests run the server from another environment."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any


pids: dict[str, int] = {}  # base URL -> the server's process id, while it runs


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running(model: Path, log: Path, extra: Sequence[str] = (), *, python: str = sys.executable,
            env: Mapping[str, str] | None = None, timeout: float = 300.0) -> Iterator[str]:
    """A server of ``model`` (token ids in and out, bf16, eager) with ``extra`` flags; yields its base URL once it
    answers ``/health``, stops it after. ``env``: the server's environment (default: this process's)."""
    port = _port()
    base = f"http://127.0.0.1:{port}"
    # a server as users run it: its engine in a process of its own (the in-process tests switch that off for themselves)
    environment = {**(os.environ if env is None else env), "VLLM_SERVER_DEV_MODE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with log.open("w") as out:
        server = subprocess.Popen(
            [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
             "--port", str(port), "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len",
             "128", "--seed", "0", "--weight-transfer-config", json.dumps({"backend": "rlsync"}), *extra],
            env=environment, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    urllib.request.urlopen(base + "/health", timeout=2).close()
                    break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"vLLM server did not start:\n{log.read_text()[-4000:]}") from None
                    time.sleep(1)
            pids[base] = server.pid
            yield base
        finally:
            pids.pop(base, None)
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


def post(base: str, route: str, body: dict[str, Any], timeout: float = 180) -> Any:
    """One JSON request; the answer as JSON, or as text where the route answers text (the LoRA routes)."""
    request = urllib.request.Request(base + route, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read()
        if response.headers.get_content_type() != "application/json":
            return text.decode()
    return json.loads(text) if text.strip() else None


def greedy(base: str, model: str, prompts: Sequence[Sequence[int]], tokens: int, *,
           ignore_eos: bool = False) -> list[list[int]]:
    """Greedy completions (token ids) of each prompt from ``model`` (the served model's name, or an adapter's)."""
    return [list(post(base, "/v1/completions", {"model": model, "prompt": list(prompt), "max_tokens": tokens,
                                                "temperature": 0.0, "return_token_ids": True,
                                                "ignore_eos": ignore_eos})["choices"][0]["token_ids"])
            for prompt in prompts]
