"""A Redis writer that is not the run (issue #66, items 13-14): anyone who can write to the run's Redis puts entries
where rlsync reads them, with a plain redis-py client. Judged by what the trainer gets (every honest sample, no
foreign one), whether it ever raises, and what a resumed episode replays (only what this run recorded)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest

redis = pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (Debian package 'redis-server')", allow_module_level=True)

from rlsync import Episode, Sample, Turn, encode_sample, make_buffer  # noqa: E402
from rlsync.plugins import RedisEpisodes, RedisStorage  # noqa: E402

from tests._support.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.redis


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    running = RedisServer(tmp_path)
    running.start()
    yield running
    if running.proc and running.proc.poll() is None:
        running.kill()


def sample(i: int) -> Sample:
    return Sample(f"p{i}", np.arange(40, dtype=np.int32), 8, np.zeros(32, np.float32), np.zeros(32, np.int32), sample_id=f"s{i}")


def _plant(client: object, name: str, sample_id: str, payload: bytes) -> None:
    """A sample at the head of the queue (score 0), as the buffer's own keys hold one: not signed by the run."""
    client.sadd(f"{name}:ids", sample_id)  # type: ignore[attr-defined]
    client.hset(f"{name}:payload", sample_id, payload)  # type: ignore[attr-defined]
    client.hset(f"{name}:order", sample_id, 0)  # type: ignore[attr-defined]
    client.zadd(f"{name}:queue", {sample_id: 0})  # type: ignore[attr-defined]


@pytest.mark.parametrize("entry", ["garbage", "a well-formed sample"])
def test_a_foreign_sample_at_the_head_of_the_queue_holds_no_honest_one_and_crashes_no_trainer(server: RedisServer,
                                                                                            entry: str) -> None:
    """Item 13. Before: one foreign entry at the head made every (restarted) trainer's ``get`` raise at its decode,
    after the batch was leased: 0 of 8 honest samples delivered, the entry back every time its lease ran out. A
    well-formed sample (the encoding is public) went to the trainer as if the run had generated it."""
    attacker = redis.Redis.from_url(server.url)
    payload = b"\x00\x01not msgpack" if entry == "garbage" else encode_sample(sample(99))
    _plant(attacker, "run", "s99", payload)
    generator = make_buffer("redis", url=server.url, name="run", batch_size=8, max_staleness=4)
    for i in range(8):
        generator.put(sample(i), generator.admit())
    trainer = RedisStorage(server.url, name="run", lease_seconds=1)
    buffer = make_buffer("redis", url=server.url, name="run", batch_size=8, max_staleness=4)
    batch = buffer.get(timeout=10)
    assert sorted(s.sample_id for s in batch.samples) == [f"s{i}" for i in range(8)]
    assert buffer.storage.foreign == 1  # type: ignore[attr-defined]
    assert attacker.zscore("run:queue", "s99") is None and attacker.zscore("run:leased", "s99") is None
    time.sleep(1.2)
    assert trainer.take(10) == []  # nothing comes back when a lease runs out
    attacker.close()


def _turn() -> Turn:
    return Turn([7, 8], [3, 3], [-0.1, -0.2])


def test_an_episode_replays_only_what_this_run_recorded(server: RedisServer) -> None:
    """Item 14. Before: a pushed ``done`` step made a resumed episode return a tool result that was never produced (the
    tool never ran); a pre-seeded episode trained a turn the engine never generated; a garbage step failed every
    claim of the episode."""
    attacker = redis.Redis.from_url(server.url)
    log = RedisEpisodes(server.url, name="run")
    calls: list[str] = []

    def search(key: str) -> str:
        calls.append(key)
        return "found"

    # a generator records its turn and starts a tool call, then dies; a forged result is pushed after its steps
    dying = Episode.claim(log, "e1", b"prompt", "worker-a", lease_seconds=0.2)
    assert dying is not None
    dying.turn(_turn)
    started = dying._tool_started("search", {"q": "x"})  # the call went out; the generator died in it
    assert started[1] is None
    attacker.rpush("run:ep:e1:steps", msgspec.msgpack.encode({"type": "done", "result": "forged"}))
    time.sleep(0.3)
    resumed = Episode.claim(log, "e1", b"prompt", "worker-b")
    assert resumed is not None and resumed.recorded == 2  # the turn and the call's start: the forged result is cut
    assert resumed.turn(lambda: pytest.fail("the recorded turn replays")) == _turn()
    assert resumed.tool("search", search, {"q": "x"}) == "found" and calls == ["e1/1"]  # the tool really ran
    assert resumed.finish(sample(1))
    assert log.foreign == 1

    # a garbage step: the claim cuts it instead of failing at its decode, every time
    ok = Episode.claim(log, "e2", b"prompt", "worker-a", lease_seconds=0.2)
    assert ok is not None
    ok.turn(_turn)
    attacker.rpush("run:ep:e2:steps", b"\xc1garbage")
    time.sleep(0.3)
    again = Episode.claim(log, "e2", b"prompt", "worker-b")
    assert again is not None and again.recorded == 1 and again.turn(lambda: pytest.fail("replayed")) == _turn()

    # a pre-seeded episode, claimable as the run's own; and one under an id the run is about to use
    for planted in ("evil", "e3"):
        attacker.hset(f"run:ep:{planted}", mapping={"prompt": b"a prompt the run never had", "epoch": 0, "done": 0})
        attacker.rpush(f"run:ep:{planted}:steps", msgspec.msgpack.encode({"type": "turn", "turn": {
            "tokens": [1, 2], "versions": [0, 0], "logprobs": [0.0, 0.0]}}))
        attacker.zadd("run:ep-claimable", {planted: 0})
    assert Episode.claim(log, "e3", b"prompt", "worker-c") is None  # the foreign one under that id is removed...
    mine = Episode.claim(log, "e3", b"prompt", "worker-c")  # ... and the run's own goes in its place
    assert mine is not None and not mine.resumed and mine.prompt == b"prompt"
    assert Episode.next(log, "worker-c") is None  # the other is removed too: no honest episode waits
    assert attacker.zscore("run:ep-claimable", "evil") is None
    assert log.foreign >= 3
    attacker.close()


def test_the_buffers_counters_are_this_runs_or_none(server: RedisServer) -> None:
    """The saved counters (the published version) and the episodes' generation: a foreign value is refused, never a
    crash (``int()`` of it raised before) nor a version the run did not publish."""
    storage = RedisStorage(server.url, name="run")
    storage.save_state({"version": 5, "consumed": 3})
    assert storage.load_state() == {"version": 5, "consumed": 3}
    attacker = redis.Redis.from_url(server.url)
    attacker.set("run:state:signed", b"\x00" * 40)
    assert storage.load_state() == {} and storage.foreign == 1
    attacker.set("run:generation", "not a number")
    log = RedisEpisodes(server.url, name="run")
    assert log.run_name(fresh=False) == "run" and log.run_name(fresh=True) == "run#1"
    attacker.set("run:ep-unfinished", "x")
    assert log.unfinished() == 0
    attacker.close()
