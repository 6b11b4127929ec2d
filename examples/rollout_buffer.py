"""Generators and a trainer joined by rlsync's rollout buffer, with the plain install: a policy version on every token,
a staleness bound, and truncated importance weights for what was sampled by older weights.

    pip install torch -e .                              # nothing else
    python examples/rollout_buffer.py                   # max staleness 1: generators run at most one version ahead
    python examples/rollout_buffer.py --max-staleness 0 # lockstep: no token is ever older than the trainer's weights
    python examples/rollout_buffer.py --backend redis   # the same through Redis (pip install 'rlsync[redis]', a server)

The policy is a softmax over 16 "tokens"; the reward is the share of token 0 in a completion. Generator threads sample
completions token by token, each token from the newest weights published so far (as an engine that takes a sync in
the middle of a request does), and put each completion with the version of every token. The trainer takes batches,
scores the tokens under its current weights, weights each token's policy gradient by its truncated importance weight
(its probability now over the one it was sampled with), steps, and publishes the next version. Each step prints the
batch's version lags and importance weights; the reward climbs from 1/16 towards 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import threading
import time
from typing import Any

import numpy as np

VOCAB, LENGTH = 16, 12


def logprobs(theta: np.ndarray) -> np.ndarray:
    shifted = theta - theta.max()
    return shifted - np.log(np.exp(shifted).sum())


def generate(buffer: Any, weights: dict[int, np.ndarray], latest: list[int], stop: threading.Event, seed: int) -> None:
    """One generator: admitted by the buffer (the staleness bound), then one token at a time on the newest weights."""
    import rlsync

    rng = np.random.default_rng(seed)
    n = 0
    while not stop.is_set():
        ticket = buffer.admit(timeout=0.2)  # waits while generating more would break the bound
        if ticket is None:
            continue
        tokens, sampled_logprobs, versions = [], [], []
        for _ in range(LENGTH):
            version = latest[0]
            lp = logprobs(weights[version])
            token = int(rng.choice(VOCAB, p=np.exp(lp)))
            tokens.append(token)
            sampled_logprobs.append(lp[token])
            versions.append(version)
            time.sleep(rng.exponential(0.002))  # decoding takes time; some completions take much longer
        sample = rlsync.Sample(f"g{seed}-{n}", np.array([VOCAB, *tokens]), 1, np.array(sampled_logprobs, np.float32),
                               np.array(versions, np.int64), reward=tokens.count(0) / LENGTH)
        buffer.put(sample, ticket)
        n += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--generators", type=int, default=4)
    parser.add_argument("--backend", choices=["memory", "redis", "ray"], default="memory")
    parser.add_argument("--url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), help="with --backend redis")
    args = parser.parse_args()
    needs = {"redis": ("redis", "rlsync[redis]"), "ray": ("ray", "rlsync[ray]")}.get(args.backend)
    if needs and importlib.util.find_spec(needs[0]) is None:
        raise SystemExit(f"--backend {args.backend} needs {needs[0]}: pip install '{needs[1]}' (or leave --backend out)")

    import rlsync

    options = {"url": args.url, "name": f"example-{os.getpid()}"} if args.backend == "redis" else {}
    buffer = rlsync.make_buffer(args.backend, batch_size=args.batch, max_staleness=args.max_staleness, **options)
    theta = np.zeros(VOCAB)
    weights, latest, stop = {0: theta.copy()}, [0], threading.Event()
    threads = [threading.Thread(target=generate, args=(buffer, weights, latest, stop, seed), daemon=True)
               for seed in range(args.generators)]
    for t in threads:
        t.start()
    try:
        for step in range(1, args.steps + 1):
            batch = buffer.get(timeout=60)
            assert batch is not None, "no batch in 60 s"
            now = logprobs(theta)
            trainer_logprobs = [now[s.tokens[s.prompt_len:]].astype(np.float32) for s in batch.samples]
            is_weights = batch.importance_weights(trainer_logprobs, cap=2.0)
            rewards = np.array([s.reward for s in batch.samples])
            advantage = rewards - rewards.mean()
            grad = np.zeros(VOCAB)
            for s, a, w in zip(batch.samples, advantage, is_weights):
                for token, weight in zip(s.tokens[s.prompt_len:], w):  # d log p(token) / d theta = onehot - p
                    grad += a * weight * (np.eye(VOCAB)[token] - np.exp(now))
            theta = theta + 2.0 * grad / len(batch)
            weights[step] = theta.copy()
            latest[0] = step  # generators sample their next tokens with it
            buffer.publish(step)
            lags = np.concatenate(batch.version_lags())
            all_w = np.concatenate(is_weights)
            print(f"step {step:2d}: reward {rewards.mean():.2f}; token version lag 0/1/2+: "
                  f"{(lags == 0).mean():.0%}/{(lags == 1).mean():.0%}/{(lags >= 2).mean():.0%}; "
                  f"importance weights {all_w.min():.2f}..{all_w.max():.2f} (mean {all_w.mean():.2f})")
            assert lags.max() <= args.max_staleness  # the bound holds for every token
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        print(buffer.report())
        buffer.close()


if __name__ == "__main__":
    main()
