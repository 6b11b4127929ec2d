"""A generator process for the episode tests: claims episodes from Redis and runs a multi-turn agent loop through
``rlsync.Episode`` until none is left; killed with SIGKILL at random points by the test.

The model: a real vLLM server's greedy completions (``served``, tests/adapters/vllm/test_vllm_episodes.py), or
``next_tokens``, a deterministic function of the prefix standing in for greedy decoding where no engine runs
(tests/plugins/test_episodes.py: the log is what is under test there). The tool appends its call key to a file for
every execution (its side effect, which the tests count) and answers a token: the prefix's sum modulo ``TOOL_MOD``."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

TURNS = 3
TOKENS_PER_TURN = 6
TOOL_MOD = 251  # tool answers stay inside the tiny test models' vocabulary (256)

#: a model: the next TOKENS_PER_TURN tokens of a prefix and their log-probs
Model = Callable[[list[int]], tuple[list[int], list[float]]]


def next_tokens(prefix: list[int]) -> tuple[list[int], list[float]]:
    out, state = [], sum(prefix) * 31 + len(prefix)
    for _ in range(TOKENS_PER_TURN):
        state = (state * 1103515245 + 12345) % 2**31
        out.append(state % 1000)
    return out, [-0.5] * len(out)


def served(base: str, model: str) -> Model:
    """Greedy completions of a vLLM server (token ids in and out; no log-probs: a server without a tokenizer, as
    the tests start it, refuses to return them, so the turns record zeros)."""
    from .vllm_server import post

    def complete(prefix: list[int]) -> tuple[list[int], list[float]]:
        got = post(base, "/v1/completions", {"model": model, "prompt": prefix, "max_tokens": TOKENS_PER_TURN,
                                             "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})["choices"][0]
        return list(got["token_ids"]), [0.0] * len(got["token_ids"])

    return complete


def expected_tokens(prompt: list[int], model: Model) -> list[int]:
    """The tokens of an episode run without a kill: what every resumed one must end with."""
    tokens = list(prompt)
    for t in range(TURNS):
        tokens += model(tokens)[0]
        if t < TURNS - 1:
            tokens.append(sum(tokens) % TOOL_MOD)
    return tokens


def run_episode(episode: object, tool_log: str, delay: float, model: Model = next_tokens,
                recorded_steps: Any = None) -> list[int]:
    """The agent loop: TURNS model turns, a tool call after each but the last; the sample's tokens.
    ``recorded_steps(episode_id)``, where given, says how many steps the log holds (an observer outside rlsync)."""
    from rlsync import Episode, Turn

    assert isinstance(episode, Episode)
    tokens = list(msgspec.msgpack.decode(episode.prompt))

    def generate() -> Turn:
        time.sleep(delay)  # a turn takes a while: kills land mid-turn too
        new, logprobs = model(tokens)
        return Turn(new, [0] * len(new), logprobs)

    def count(key: str) -> int:
        episode_id, step = key.rsplit("/", 1)
        # a result already recorded for this call (the step after its start) means the tool should not be running
        again = recorded_steps is not None and recorded_steps(episode_id) > int(step) + 1
        with open(tool_log, "a") as out:  # the side effect, one line per execution
            out.write(key + (" AFTER-ITS-RESULT-WAS-RECORDED" if again else "") + "\n")
        time.sleep(delay / 2)
        return sum(tokens) % TOOL_MOD

    for t in range(TURNS):
        tokens += episode.turn(generate).tokens
        if t < TURNS - 1:
            tokens.append(episode.tool("count", count, {"turn": t}))
    return tokens


def main(url: str, name: str, tool_log: str, owner: str, base: str = "", served_model: str = "") -> None:
    import redis

    from rlsync import Episode, LeaseLostError, Sample
    from rlsync.plugins import RedisEpisodes

    log = RedisEpisodes(url, name=name)
    observer = redis.Redis.from_url(url)  # reads the log's step list directly (RedisEpisodes' key layout)

    def recorded_steps(episode_id: str) -> int:
        return int(observer.llen(f"{name}:ep:{episode_id}:steps"))

    rng = np.random.default_rng(os.getpid())
    model = served(base, served_model) if base else next_tokens
    with open(tool_log + ".ready", "a") as ready:  # imports done: the test kills only generators at work
        ready.write(owner + "\n")
    while log.unfinished():
        episode = Episode.next(log, owner, lease_seconds=0.6)
        if episode is None:  # the rest is leased: wait for a lease to run out, or for the rest to finish
            time.sleep(0.05)
            continue
        if episode.resumed:
            with open(tool_log + ".resumed", "a") as out:  # how far the dead generator got: steps recorded
                out.write(f"{episode.episode_id} {episode.recorded}\n")
        try:
            tokens = run_episode(episode, tool_log, float(rng.uniform(0.02, 0.06)), model, recorded_steps)
            prompt_len = len(msgspec.msgpack.decode(episode.prompt))
            generated = len(tokens) - prompt_len
            episode.finish(Sample(episode.episode_id, np.array(tokens), prompt_len, np.zeros(generated, np.float32),
                                  np.zeros(generated, np.int64)))
        except LeaseLostError:
            continue  # another generator has it now
    print("no episode left", flush=True)


def run_with_kills(url: str, workdir: Path, *, episodes: int, kills: int, served_at: tuple[str, str] | None = None,
                   generators: int = 4, seed: int = 7) -> None:
    """``episodes`` episodes of random prompts in Redis at ``url``, run by ``generators`` processes of this module (the
    model: the vLLM server ``served_at`` = (base URL, model name), else ``next_tokens``), a working one killed with
    SIGKILL every 0.1-0.3 s until ``kills`` kills, each replaced. Then asserts: every episode ends as exactly one
    sample whose tokens are those of a run without a kill, no tool call ran after its result was recorded, tool calls
    ran again at most once per kill, and enough resumes went past a recorded tool result to show it."""
    from rlsync.plugins import RedisEpisodes, RedisStorage

    rng = random.Random(seed)
    prompts = {f"ep{i}": [rng.randrange(TOOL_MOD) for _ in range(rng.randrange(3, 9))] for i in range(episodes)}
    tool_log, ready = workdir / "tool-calls", workdir / "tool-calls.ready"
    tool_log.touch()
    log = RedisEpisodes(url, name="kill")
    for episode_id, prompt in prompts.items():
        assert log.add(episode_id, msgspec.msgpack.encode(prompt))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    model_args = list(served_at) if served_at is not None else []

    def spawn(n: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "tests._support.episode_generator", url, "kill", str(tool_log),
                                 f"gen-{n}", *model_args], cwd=root, env=env, stdout=subprocess.DEVNULL)

    running = {f"gen-{n}": spawn(n) for n in range(generators)}
    spawned, killed, deadline = generators, 0, time.monotonic() + 300
    try:
        while log.unfinished() and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.1, 0.3))
            failed = {n: g.returncode for n, g in running.items() if g.poll() not in (None, 0)}
            assert not failed, f"generators failed on their own (not killed): {failed}; their errors are above"
            working = sorted(set(ready.read_text().split()) & running.keys()) if ready.exists() else []
            if killed < kills and working:  # at work (imports done): most hold an episode mid-turn or mid-call
                victim = running.pop(rng.choice(working))
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                killed += 1
                running[f"gen-{spawned}"] = spawn(spawned)
                spawned += 1
        for g in running.values():
            g.wait(timeout=120)
    finally:
        for g in running.values():
            g.kill()
    assert log.unfinished() == 0, f"{log.unfinished()} episodes unfinished after {killed} kills"
    assert killed == kills, f"only {killed} kills"
    samples = RedisStorage(url, name="kill").take(10 * episodes)
    ids = [s.sample_id for s in samples]
    assert len(ids) == len(set(ids)) == episodes and set(ids) == set(prompts)
    model = served(*served_at) if served_at is not None else next_tokens
    for s in samples:
        assert s.tokens.tolist() == expected_tokens(prompts[s.sample_id], model), \
            f"episode {s.sample_id} ended with other tokens than a run without a kill"
    resumed = [int(line.split()[1]) for line in Path(f"{tool_log}.resumed").read_text().splitlines()]
    assert sum(steps >= 3 for steps in resumed) >= 5, f"too few resumes past a recorded tool result to show anything: {resumed}"
    lines = tool_log.read_text().splitlines()
    assert not [line for line in lines if "AFTER" in line], "a tool call ran after its result was recorded"
    executions = collections.Counter(lines)
    assert set(executions) == {f"{e}/{step}" for e in prompts for step in (1, 4)}  # turn, started, done, turn, ...
    again = {key: n for key, n in executions.items() if n > 1}
    assert sum(n - 1 for n in again.values()) <= killed, f"tool calls ran again more often than generators died: {again}"


if __name__ == "__main__":
    main(*sys.argv[1:7])
