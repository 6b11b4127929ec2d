"""Episodes that outlive their generator (``rlsync.Episode``): the ``EpisodeLog`` contract on memory and a real
Redis, and generator processes killed with SIGKILL at random points while running multi-turn episodes with a
tool that has a side effect."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rlsync import ConfigError, MemoryEpisodes, MemoryStorage, RolloutBufferError
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
        def claim(self, owner: str, lease_seconds: float, episode_id: str | None = None) -> Claim | None:
            got = super().claim(owner, lease_seconds, episode_id)
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


def test_an_asyncio_agent_claims_its_episode_by_id_and_replays_it_after_a_death() -> None:
    """``Episode.claim`` with ``turn_async``/``tool_async`` (verl's agent loop runs on asyncio): the episode of a
    generator that died is taken by id once its lease ran out, its turn and tool result replayed (the tool is not
    called again), and a finished episode is said so (nothing replayed, nothing recorded)."""
    import asyncio

    from rlsync import Episode, Turn

    storage = MemoryStorage()
    log = MemoryEpisodes(storage.append)
    calls: list[str] = []

    async def generate() -> Turn:
        return Turn([7, 8], [3, 3], [-0.1, -0.2], extra={"stop_reason": "completed"})

    async def search(key: str) -> str:
        calls.append(key)
        return "found"

    async def agent(episode: Episode) -> tuple[Turn, str]:
        return await episode.turn_async(generate), await episode.tool_async("search", search, {"q": "x"})

    dying = Episode.claim(log, "step1/0", b"prompt", "worker-a", lease_seconds=0.1)
    assert dying is not None and not dying.resumed
    assert asyncio.run(agent(dying)) == (Turn([7, 8], [3, 3], [-0.1, -0.2], extra={"stop_reason": "completed"}), "found")
    assert Episode.claim(log, "step1/0", b"prompt", "worker-b") is None  # its lease still runs: not handed out twice
    time.sleep(0.2)  # worker-a died after its tool call
    again = Episode.claim(log, "step1/0", b"prompt", "worker-b")
    assert again is not None and again.recorded == 3
    turn, result = asyncio.run(agent(again))
    assert turn.extra == {"stop_reason": "completed"} and result == "found" and calls == ["step1/0/1"]
    assert again.finish(None) and storage.take(10) == []  # verl takes the trajectory from the loop itself
    ended = Episode.claim(log, "step1/0", b"prompt", "worker-c")  # the framework re-runs it (a restarted step)
    assert ended is not None and ended.finished
    assert asyncio.run(agent(ended))[1] == "found" and calls == ["step1/0/1"]  # replayed whole, the tool not called
    assert not ended.finish(None)
    with pytest.raises(RolloutBufferError, match="finished before this claim, after 3 steps"):
        asyncio.run(ended.turn_async(generate))
    with pytest.raises(RolloutBufferError, match="recorded for another prompt"):
        log.add("step1/1", b"one prompt")
        Episode.claim(log, "step1/1", b"another prompt", "worker-c")


def test_a_kept_lease_holds_an_episode_past_its_lease_and_a_waiting_claim_gets_it_once_it_runs_out() -> None:
    """``keep_lease`` (beside a step longer than the lease) keeps another worker's ``claim_when_free`` waiting; once
    the holder stops renewing (it died), the waiting claim gets the episode, with its steps."""
    import asyncio

    from rlsync import Episode, Turn

    log = MemoryEpisodes(MemoryStorage().append)

    async def scenario() -> tuple[float, int]:
        holder = await Episode.claim_when_free(log, "e", b"p", "a", lease_seconds=0.2)
        holder.turn(lambda: Turn([1], [0], [0.0]))
        keep = asyncio.ensure_future(holder.keep_lease())
        start = asyncio.get_running_loop().time()
        waiting = asyncio.ensure_future(Episode.claim_when_free(log, "e", b"p", "b", lease_seconds=0.2))
        await asyncio.sleep(0.6)  # three leases: the holder's renewals keep it
        assert not waiting.done(), "an episode whose lease is kept was handed to another worker"
        keep.cancel()  # the holder dies
        taken = await waiting
        return asyncio.get_running_loop().time() - start, taken.recorded

    waited, recorded = asyncio.run(scenario())
    assert 0.6 <= waited < 1.5 and recorded == 1


def test_a_step_that_no_episode_recorded_is_refused_by_name() -> None:
    from rlsync import Episode

    log = MemoryEpisodes(MemoryStorage().append)
    log.add("e", b"")
    claim = log.claim("a", 0)
    assert claim is not None
    log.record("e", claim.epoch, 0, b"\xc1 not msgpack", 0)  # a log is bytes: something else wrote this one
    with pytest.raises(RolloutBufferError, match="episode e: a recorded step is not an rlsync step"):
        Episode.next(log, "b")


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
@pytest.mark.parametrize("given", ["argument", "url"])
def test_redis_keeps_an_episode_finished_without_a_sample_for_kept_seconds_then_forgets_it(tmp_path: Path, given: str) -> None:
    """What a framework's re-run replays lives in Redis ``kept_seconds`` (then expires: the memory of a long run is
    bounded); an episode finished with a sample keeps no steps. #59: the kept time rides in the episodes URL
    (``?kept_seconds=N``), so the one episodes option of verl and TRL sets it too."""
    pytest.importorskip("redis")
    import time

    import numpy as np
    import redis

    from rlsync import Sample
    from rlsync.plugins import RedisEpisodes

    with RedisServer.running(tmp_path) as server:
        if given == "url":
            with pytest.raises(ConfigError, match=r"kept_seconds='-1' in redis://.*above 0"):
                RedisEpisodes(server.url + "?kept_seconds=-1", name="kept")
        log = (RedisEpisodes(server.url, name="kept", kept_seconds=2) if given == "argument" else
               RedisEpisodes(server.url + "?kept_seconds=2", name="kept"))
        for episode_id in ("by-id", "with-sample"):
            log.add(episode_id, b"p")
            claim = log.claim("w", 30, episode_id)
            assert claim is not None
            log.record(episode_id, claim.epoch, 0, b"s0", 30)
            sample = Sample(episode_id, np.array([1, 2]), 1, np.zeros(1, np.float32), np.zeros(1, np.int64))
            assert log.finish(episode_id, claim.epoch, None if episode_id == "by-id" else sample)
        raw = redis.Redis.from_url(server.url)
        assert 0 < raw.ttl("kept:ep:by-id:steps") <= 2 and raw.ttl("kept:ep:by-id") > 0
        assert not raw.exists("kept:ep:with-sample:steps")
        again = log.claim("v", 30, "by-id")
        assert again is not None and again.done and again.steps == [b"s0"]
        time.sleep(2.5)
        assert log.claim("v", 30, "by-id") is None  # forgotten: an id the log no longer knows


@pytest.mark.redis
@pytest.mark.multiproc
def test_generators_killed_at_random_lose_no_episode_and_rerun_no_recorded_tool_call(tmp_path: Path) -> None:
    """100 three-turn episodes (a tool call between turns) run by 4 generator processes, a working one killed with
    SIGKILL every 0.1-0.3 s (25 kills) and replaced: every episode ends as exactly one sample, its tokens those of
    the same episode run without a kill; a tool call runs twice only when its generator died during it (at most once
    per kill), never after its result was recorded (an observer reads the log in Redis before each execution); Redis
    is the only thing that survives. The model: a deterministic stand-in (``episode_generator.next_tokens``)."""
    pytest.importorskip("redis")
    with RedisServer.running(tmp_path) as server:
        episode_generator.run_with_kills(server.url, tmp_path, episodes=100, kills=25)


def test_a_frameworks_episodes_option_is_named_in_every_error_about_its_url() -> None:
    """The one check behind verl's, TRL's and OpenRLHF's episodes options: the setting as the user wrote it leads the
    error, its password never shows, and nothing is sent (no Redis listens here)."""
    pytest.importorskip("redis")
    from rlsync.plugins import RedisEpisodes

    option = "RlsyncWeightTransfer(episodes={url})"
    with pytest.raises(ConfigError, match=r"^RlsyncWeightTransfer\(episodes='http://<credentials>@h:6379/0'\): .*"
                                          r"for example redis://HOST:6379/0") as typo:
        RedisEpisodes.from_option("http://:hunter2@h:6379/0", name="run", option=option)
    with pytest.raises(ConfigError, match=r"^--episodes='redis://h:6379/0\?kept_seconds=0': kept_seconds='0'") as kept:
        RedisEpisodes.from_option("redis://h:6379/0?kept_seconds=0", name="run", option="--episodes={url}")
    assert "hunter2" not in str(typo.value) + str(kept.value)
    log = RedisEpisodes.from_option("redis://127.0.0.1:9/0?kept_seconds=60", name="run", option="--episodes={url}")
    assert log.kept_seconds == 60


@pytest.mark.redis
def test_a_fresh_run_under_a_used_name_starts_a_generation_of_its_own_and_a_resumed_one_goes_on(tmp_path: Path) -> None:
    """A trainer started over in the same output folder must not replay what the run before recorded there; a run
    resumed from its checkpoint must find what it recorded itself."""
    pytest.importorskip("redis")
    from rlsync.plugins import RedisEpisodes

    with RedisServer.running(tmp_path) as server:
        log = RedisEpisodes(server.url, name="rlsync-episodes:/runs/a")
        assert log.run_name(fresh=False) == "rlsync-episodes:/runs/a"  # recorded before generations: found as it was
        first = log.run_name(fresh=True)
        assert first == "rlsync-episodes:/runs/a#1" and log.run_name(fresh=False) == first
        recorded = RedisEpisodes(server.url, name=first)
        recorded.add("step-1/prompt-0", b"p")
        second = log.run_name(fresh=True)  # started over
        assert second == "rlsync-episodes:/runs/a#2" and log.run_name(fresh=False) == second
        again = RedisEpisodes(server.url, name=second)
        assert again.add("step-1/prompt-0", b"p")  # new to this run: generated, not replayed from the first
        assert not recorded.add("step-1/prompt-0", b"p")  # the first run's record is still there, under its own name
        assert RedisEpisodes(server.url, name="rlsync-episodes:/runs/b").run_name(fresh=True).endswith("/b#1")


def test_a_run_name_asked_where_no_redis_answers_names_the_option() -> None:
    """At a framework's door (OpenRLHF's launcher, TRL's first sync): a Redis that does not answer is the option's
    error, not the buffer's (whose fix says url=)."""
    import socket

    pytest.importorskip("redis")
    from rlsync.plugins import RedisEpisodes

    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = RedisEpisodes.from_option(f"redis://:hunter2@127.0.0.1:{port}/0", name="run", option="--episodes={url}")
    log.retry_seconds = 0.2
    with pytest.raises(ConfigError, match=r"^--episodes='redis://<credentials>@127.0.0.1:\d+/0': no Redis answered") as dead:
        log.run_name(fresh=True)
    assert "hunter2" not in str(dead.value) and "url=" not in str(dead.value)
