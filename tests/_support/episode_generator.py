"""A generator process for the episode tests: claims episodes from Redis and runs a multi-turn agent loop through
``rlsync.Episode`` until none is left; killed with SIGKILL at random points by the test.

The "model" is ``next_tokens``, a deterministic function of the prefix standing in for greedy decoding (the log is
what is under test here; tests/frameworks/vllm runs the same loop against a real vLLM server). The tool appends its
call key to a file for every execution (its side effect, which the test counts) and answers the token sum."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import msgspec
import numpy as np

TURNS = 3
TOKENS_PER_TURN = 6


def next_tokens(prefix: list[int], count: int) -> list[int]:
    out, state = [], sum(prefix) * 31 + len(prefix)
    for _ in range(count):
        state = (state * 1103515245 + 12345) % 2**31
        out.append(state % 1000)
    return out


def run_episode(episode: object, tool_log: str, delay: float, recorded_steps: Any = None) -> list[int]:
    """The agent loop: TURNS model turns, a tool call after each but the last; the sample's tokens.
    ``recorded_steps(episode_id)``, where given, says how many steps the log holds (an observer outside rlsync)."""
    from rlsync import Episode, Turn

    assert isinstance(episode, Episode)
    tokens = list(msgspec.msgpack.decode(episode.prompt))

    def generate() -> Turn:
        time.sleep(delay)  # a turn takes a while: kills land mid-turn too
        new = next_tokens(tokens, TOKENS_PER_TURN)
        return Turn(new, [1] * len(new), [-0.5] * len(new))

    def count(key: str) -> int:
        episode_id, step = key.rsplit("/", 1)
        # a result already recorded for this call (the step after its start) means the tool should not be running
        again = recorded_steps is not None and recorded_steps(episode_id) > int(step) + 1
        with open(tool_log, "a") as out:  # the side effect, one line per execution
            out.write(key + (" AFTER-ITS-RESULT-WAS-RECORDED" if again else "") + "\n")
        time.sleep(delay / 2)
        return sum(tokens) % 997

    for t in range(TURNS):
        tokens += episode.turn(generate).tokens
        if t < TURNS - 1:
            tokens.append(episode.tool("count", count, {"turn": t}))
    return tokens


def main(url: str, name: str, tool_log: str, owner: str) -> None:
    import redis

    from rlsync import Episode, LeaseLostError, Sample
    from rlsync.plugins import RedisEpisodes

    log = RedisEpisodes(url, name=name)
    observer = redis.Redis.from_url(url)  # reads the log's step list directly (RedisEpisodes' key layout)

    def recorded_steps(episode_id: str) -> int:
        return int(observer.llen(f"{name}:ep:{episode_id}:steps"))

    rng = np.random.default_rng(os.getpid())
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
            tokens = run_episode(episode, tool_log, float(rng.uniform(0.02, 0.06)), recorded_steps)
            prompt_len = len(msgspec.msgpack.decode(episode.prompt))
            generated = len(tokens) - prompt_len
            episode.finish(Sample(episode.episode_id, np.array(tokens), prompt_len, np.zeros(generated, np.float32),
                                  np.ones(generated, np.int64)))
        except LeaseLostError:
            continue  # another generator has it now
    print("no episode left", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:5])
