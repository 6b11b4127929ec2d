"""Episodes that outlive their generator (``rlsync.Episode``): the ``EpisodeLog`` contract on memory and a real
Redis, and generator processes killed with SIGKILL at random points while running multi-turn episodes with a
tool that has a side effect."""

from __future__ import annotations

import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rlsync import MemoryEpisodes, MemoryStorage, RolloutBufferError
from rlsync.testing import check_episode_log
from tests._support import episode_generator
from tests._support.redis_server import RedisServer


def test_memory_episodes_keep_the_contract() -> None:
    def make() -> tuple[MemoryEpisodes, object]:
        storage = MemoryStorage()
        return MemoryEpisodes(storage.append), lambda: storage.take(100)

    check_episode_log(make)  # type: ignore[arg-type]


def test_the_contract_check_fails_a_log_that_runs_a_recorded_tool_again() -> None:
    """The check can fail: a log that forgets steps on a new claim (so a resumed episode calls its tool again)."""
    from rlsync import Claim

    class Forgetful(MemoryEpisodes):
        def claim(self, owner: str, lease_seconds: float) -> Claim | None:
            got = super().claim(owner, lease_seconds)
            return None if got is None else Claim(got.episode_id, got.epoch, got.prompt, [])

    storage = MemoryStorage()
    with pytest.raises(AssertionError, match="claimed again with its steps"):
        check_episode_log(lambda: (Forgetful(storage.append), lambda: storage.take(100)))  # type: ignore[arg-type, return-value]


def test_a_resumed_agent_that_takes_other_steps_is_told_so() -> None:
    from rlsync import Episode, Turn

    storage = MemoryStorage()
    log = MemoryEpisodes(storage.append)
    log.add("e", b"")
    first = Episode.next(log, "a", lease_seconds=0.05)
    assert first is not None
    first.turn(lambda: Turn([1], [0], [0.0]))
    time.sleep(0.1)
    again = Episode.next(log, "b")
    assert again is not None
    with pytest.raises(RolloutBufferError, match="recorded as _TurnStep, the agent now asks for _ToolStarted"):
        again.tool("search", lambda key: None)


@pytest.mark.redis
def test_redis_episodes_keep_the_contract(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    from rlsync.plugins import RedisEpisodes, RedisStorage

    with RedisServer.running(tmp_path) as server:
        names = iter(range(100))

        def make() -> tuple[RedisEpisodes, object]:
            name = f"c{next(names)}"
            storage = RedisStorage(server.url, name=name)
            return RedisEpisodes(server.url, name=name), lambda: storage.take(100)

        check_episode_log(make)  # type: ignore[arg-type]


@pytest.mark.redis
@pytest.mark.multiproc
def test_generators_killed_at_random_lose_no_episode_and_rerun_no_recorded_tool_call(tmp_path: Path) -> None:
    """100 three-turn episodes (a tool call between turns) run by 4 generator processes, one of which is killed with
    SIGKILL every 0.15-0.4 s (at least 20 kills) and replaced: every episode ends as exactly one sample, its tokens
    those of the same episode run without a kill; a tool call runs twice only when its generator died during it
    (at most once per kill), never after its result was recorded (an observer reads the log in Redis before each
execution); Redis is the only thing that survives."""
    pytest.importorskip("redis")
    from rlsync.plugins import RedisEpisodes, RedisStorage

    episodes, kills_wanted = 100, 20
    tool_log = tmp_path / "tool-calls"
    tool_log.touch()
    rng = random.Random(7)
    prompts = {f"ep{i}": [rng.randrange(1000) for _ in range(rng.randrange(3, 9))] for i in range(episodes)}
    with RedisServer.running(tmp_path) as server:
        log = RedisEpisodes(server.url, name="kill")
        for episode_id, prompt in prompts.items():
            assert log.add(episode_id, msgspec.msgpack.encode(prompt))
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": str(root)}

        def spawn(n: int) -> subprocess.Popen[bytes]:
            return subprocess.Popen([sys.executable, "-m", "tests._support.episode_generator", server.url, "kill",
                                     str(tool_log), f"gen-{n}"], cwd=root, env=env, stdout=subprocess.DEVNULL)

        ready = Path(f"{tool_log}.ready")
        spawned = 4
        generators = {f"gen-{n}": spawn(n) for n in range(spawned)}
        kills, deadline = 0, time.monotonic() + 240
        while log.unfinished() and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.1, 0.3))
            working = sorted(set(ready.read_text().split()) & generators.keys()) if ready.exists() else []
            if kills < kills_wanted + 5 and working:  # at work (imports done): most hold an episode mid-turn or mid-call
                victim = generators.pop(rng.choice(working))
                victim.send_signal(signal.SIGKILL)
                victim.wait()
                kills += 1
                generators[f"gen-{spawned}"] = spawn(spawned)
                spawned += 1
        for g in generators.values():
            g.wait(timeout=60)
        assert log.unfinished() == 0, f"{log.unfinished()} episodes unfinished after {kills} kills"
        samples = RedisStorage(server.url, name="kill").take(10 * episodes)
    assert kills >= kills_wanted, f"only {kills} kills"
    ids = [s.sample_id for s in samples]
    assert len(ids) == len(set(ids)) == episodes and set(ids) == set(prompts)
    for s in samples:  # what a run without a kill gives
        expected = list(prompts[s.sample_id])
        for t in range(episode_generator.TURNS):
            expected += episode_generator.next_tokens(expected, episode_generator.TOKENS_PER_TURN)
            if t < episode_generator.TURNS - 1:
                expected.append(sum(expected) % 997)
        assert s.tokens.tolist() == expected, f"episode {s.sample_id} ended with other tokens than a run without a kill"
    resumed = [int(line.split()[1]) for line in Path(f"{tool_log}.resumed").read_text().splitlines()]
    assert sum(steps >= 3 for steps in resumed) >= 5, f"too few resumes past a recorded tool result to show anything: {resumed}"
    lines = tool_log.read_text().splitlines()
    assert not [line for line in lines if "AFTER" in line], "a tool call ran after its result was recorded"
    executions = collections.Counter(lines)
    assert set(executions) == {f"{e}/{step}" for e in prompts for step in (1, 4)}  # turn, started, done, turn, ...
    again = {key: n for key, n in executions.items() if n > 1}
    assert sum(n - 1 for n in again.values()) <= kills, f"tool calls ran again more often than generators died: {again}"
