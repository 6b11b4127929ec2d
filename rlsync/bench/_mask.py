"""``rlsync bench --sampling-mask``: what reapplying top-k/top-p in the trainer's log-probs costs, per micro-batch.

One micro-batch of ``--tokens`` positions (512) through an LM head of Qwen2.5-0.5B's shape (hidden 896, vocabulary 151936),
forward and backward, each way in a child process of its own (its peak memory is its own):

- ``logits``: the plain way, the whole ``[tokens, vocab]`` logits, ``log_softmax``, the sampled tokens' entries;
- ``masked logits``: the same with ``rlsync.masked_logprobs`` (top-k 20, top-p 0.7), the logits whole;
- ``chunked``: ``rlsync.head_logprobs`` without a mask (rows at a time, recomputed in the backward);
- ``masked chunked``: ``rlsync.head_logprobs`` with top-k 20 and top-p 0.7: what TRL's trainer runs under rlsync;
- ``top-p chunked``: the same with top-p 0.95 alone, over these nearly flat logits (no top-k: every row's set reaches
  past the most likely 1024 tokens, so the whole vocabulary is sorted, row by row: the worst case);
- ``top-p peaked``: top-p 0.95 alone over a head whose first 2000 rows are 12x the rest (as a trained head puts most
  of the mass on a few thousand tokens): rows whose set ends among the most likely 1024 skip the sort;
- ``trl fused``: TRL's own fused head (``trl.kernels.ChunkedLogProbFunction``), where TRL is installed.

Seconds: the median of ``repeats`` after one warm-up. Memory: the peak above what the inputs hold, the weight's
gradient included (on a GPU the allocator's peak; on the host the process's peak resident set).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

TOKENS, HIDDEN, VOCAB = 512, 896, 151936
TOP_K, TOP_P = 20, 0.7
WAYS = ("logits", "masked logits", "chunked", "masked chunked", "top-p chunked", "top-p peaked", "trl fused")
TOP_P_ALONE = 0.95


def _measure(way: str, device: str, repeats: int, positions: int = TOKENS) -> dict[str, Any]:
    """In the child: one way's seconds and peak bytes for a micro-batch of ``positions``."""
    import resource

    import torch

    from rlsync import head_logprobs, masked_logprobs

    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(positions, HIDDEN, generator=gen).mul_(0.5).to(device).requires_grad_()
    weight = torch.randn(VOCAB, HIDDEN, generator=gen).mul_(0.05)
    if way == "top-p peaked":
        weight[:2000] *= 12
    weight = weight.to(device).requires_grad_()
    tokens = torch.randint(0, VOCAB, (positions,), generator=gen).to(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:  # the inputs made in place: nothing freed yet, the process's peak so far is what it holds
        with open("/proc/self/statm") as statm:
            base = int(statm.read().split()[1]) * resource.getpagesize()

    def step() -> None:
        if way in ("logits", "masked logits"):
            logits = hidden @ weight.T
            if way == "logits":
                logprobs = logits.float().log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            else:
                logprobs = masked_logprobs(logits, tokens, top_k=TOP_K, top_p=TOP_P)
                logprobs = logprobs.masked_fill(~torch.isfinite(logprobs), 0.0)
        elif way == "trl fused":
            from trl.kernels import ChunkedLogProbFunction

            logprobs = ChunkedLogProbFunction.apply(hidden, weight, None, tokens, 1.0, 32768, None, 1.0, ("log_probs",))[0]
        else:
            top_k, top_p = {"chunked": (None, None), "masked chunked": (TOP_K, TOP_P), "top-p chunked": (None, TOP_P_ALONE),
                            "top-p peaked": (None, TOP_P_ALONE)}[way]
            logprobs, _ = head_logprobs(hidden, weight, None, tokens, top_k=top_k, top_p=top_p)
        logprobs.sum().backward()  # type: ignore[no-untyped-call]
        hidden.grad = weight.grad = None
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)

    step()  # warm-up: kernels, the allocator's first blocks
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"seconds": statistics.median(times), "peak_bytes": max(0, peak)}


def _available(way: str) -> str | None:
    """Why ``way`` cannot run here (None: it can)."""
    if way != "trl fused":
        return None
    import importlib.util

    return None if importlib.util.find_spec("trl") is not None else "TRL is not installed (pip install 'rlsync[trl]')"


def run(device: str | None, repeats: int, json_output: bool, tokens: int = TOKENS) -> None:
    from rlsync.bench._progress import progress, say_skipped

    device = device or "cpu"
    results: dict[str, Any] = {}
    with progress(len(WAYS), "sampling mask") as advance:
        for way in WAYS:
            why = _available(way)
            if why is not None:
                say_skipped([{"name": way, "why": why}])
                results[way] = {"skipped": why}
            else:
                out = subprocess.run([sys.executable, "-m", "rlsync.bench._mask", way, device, str(repeats), str(tokens)],
                                     capture_output=True, text=True, check=False)
                if out.returncode != 0:
                    raise RuntimeError(f"the {way!r} measurement failed: {out.stderr[-2000:]}")
                results[way] = json.loads(out.stdout.splitlines()[-1])
            advance(way)
    base = results["chunked"]
    for row in results.values():
        if "seconds" in row:
            row["x_chunked_seconds"] = row["seconds"] / base["seconds"]
    report = {"device": device, "tokens": tokens, "hidden": HIDDEN, "vocab": VOCAB, "top_k": TOP_K, "top_p": TOP_P,
              "top_p_alone": TOP_P_ALONE, "results": results}
    if json_output:
        print(json.dumps(report))
        return
    print(f"log-probs of {tokens} tokens through a {HIDDEN} x {VOCAB} LM head on {device}, forward and backward "
          f"(top-k {TOP_K}, top-p {TOP_P} where masked; top-p {TOP_P_ALONE} alone):")
    for way, row in results.items():
        if "skipped" in row:
            print(f"  {way:16s} skipped: {row['skipped']}")
        else:
            print(f"  {way:16s} {row['seconds'] * 1e3:9.1f} ms  x chunked {row['x_chunked_seconds']:5.2f}  "
                  f"peak {row['peak_bytes'] / 2**20:8.1f} MiB")


if __name__ == "__main__":
    print(json.dumps(_measure(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
