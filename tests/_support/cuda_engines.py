"""Helpers of the GPU tests (tests/gpu): a trainer process pushing a tiny Qwen2's CUDA weights, greedy output on
CUDA, and the device transports this machine has."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from _support import hf_writer
from rlsync.core import transports

PROMPT = [[3, 17, 42, 99, 5, 64]]
WRITER = Path(hf_writer.__file__)


def greedy(model: torch.nn.Module) -> list[int]:
    prompt = torch.tensor(PROMPT, device="cuda")
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,  # type: ignore[operator]
                         pad_token_id=0)
    return list(out[0, prompt.shape[1]:].tolist())


def device_transports() -> list[str]:
    registry = transports()
    return [n for n in ("cuda_ipc", "nixl") if n in registry and registry.get(n).available()]


def push(address: str, seed: int, version: int, transport: str, die_after: int = 0, verify: bool = True,
         dtype: str = "float32") -> subprocess.CompletedProcess[str]:
    """A trainer process's CUDA weights of ``seed`` pushed as ``version`` (options as the receivers' in tests/gpu)."""
    cmd = [sys.executable, str(WRITER), "--address", address, "--seed", str(seed), "--version", str(version),
           "--device", "cuda", "--transport", transport, "--dtype", dtype, *(["--verify"] if verify else []),
           *(["--die-after-writes", str(die_after)] if die_after else [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=150)
