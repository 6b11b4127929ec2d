"""The Redis-streams backend against a real redis-server (Debian's), killed with SIGKILL mid-load."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("redis")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (Debian package 'redis-server')", allow_module_level=True)

from rlsync import (
    RolloutBuffer,  # noqa: E402
    Sample,  # noqa: E402
    make_buffer,  # noqa: E402
)

from tests._support.redis_server import RedisServer  # noqa: E402

pytestmark = pytest.mark.redis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    yield server
    if server.proc and server.proc.poll() is None:
        server.kill()


def sample(i: int) -> Sample:
    return Sample(f"p{i}", np.arange(40, dtype=np.int32), 8, np.zeros(32, np.float32), np.zeros(32, np.int32), sample_id=f"s{i}")


def test_no_sample_lost_or_delivered_twice_when_redis_is_killed_mid_load(redis_server: RedisServer) -> None:
    buf = make_buffer("redis", url=redis_server.url, retry_seconds=30, batch_size=10, max_staleness=100, on_stale="drop")
    storage = buf.storage
    total = 400
    delivered: list[str] = []

    def produce() -> None:
        for start in range(0, total, 5):
            buf.put([sample(i) for i in range(start, start + 5)])

    producer = threading.Thread(target=produce)
    producer.start()
    killed = False
    while len(delivered) < total:
        batch = buf.get(timeout=60)
        assert batch is not None
        delivered += [s.sample_id for s in batch.samples]
        if not killed and len(delivered) >= 100:
            redis_server.kill()  # SIGKILL mid-load, while the producer is still adding samples
            time.sleep(0.3)
            redis_server.start()
            killed = True
    producer.join()
    assert killed
    assert len(delivered) == len(set(delivered)) == total
    assert set(delivered) == {f"s{i}" for i in range(total)}
    assert len(storage) == 0


def test_a_retried_put_adds_nothing_twice_and_state_survives_a_restart(redis_server: RedisServer) -> None:
    from rlsync.plugins import RedisStorage

    storage = RedisStorage(redis_server.url)
    storage.append([sample(1), sample(2)])
    storage.append([sample(2), sample(3)])  # a retry after a lost reply, say
    assert len(storage) == 3
    buf = RolloutBuffer(batch_size=2, max_staleness=5, storage=storage)
    assert buf.get(timeout=1) is not None
    buf.publish(1)
    redis_server.kill()
    redis_server.start()
    again = RolloutBuffer(batch_size=2, max_staleness=5, storage=RedisStorage(redis_server.url))
    assert (again.version, again.consumed, again.waiting) == (1, 2, 1)
    assert again.capacity() == (1 + 5 + 1) * 2 - 3


def versioned(i: int, version: int, group: str | None = None) -> Sample:
    return Sample(f"p{i}", np.arange(12, dtype=np.int32), 8, np.zeros(4, np.float32), np.full(4, version, np.int32),
                  sample_id=f"s{i}", group=group)


def test_samples_come_oldest_policy_version_first_then_in_arrival_order(redis_server: RedisServer) -> None:
    from rlsync import MemoryStorage
    from rlsync.plugins import RedisStorage

    arrivals = [versioned(i, v) for i, v in enumerate([3, 1, 2, 1, 0, 3, 2])]
    redis_storage, memory = RedisStorage(redis_server.url), MemoryStorage()
    for storage in (redis_storage, memory):
        storage.append(arrivals)
    got = [s.sample_id for s in redis_storage.take(4)] + [s.sample_id for s in redis_storage.take(10)]
    assert got == ["s4", "s1", "s3", "s2", "s6", "s0", "s5"]
    assert got == [s.sample_id for s in memory.take(10)]  # the same order as the embedded backend


CLIENT = """
import os, signal, sys
import numpy as np
from rlsync import RolloutBuffer
from rlsync import Sample
from rlsync.plugins import RedisStorage
buf = RolloutBuffer(batch_size=4, group_size=4, max_staleness=10, on_stale="drop",
                    storage=RedisStorage(sys.argv[1], lease_seconds=1.0))
assert buf.get(timeout=1.0) is None  # takes the 3 samples of group g, holds them: the group is incomplete
assert sum(len(g) for g in buf._groups.values()) == 3
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_samples_a_dead_client_held_come_back_once_its_lease_runs_out(redis_server: RedisServer) -> None:
    import sys

    from rlsync.plugins import RedisStorage

    producer = RedisStorage(redis_server.url)
    producer.append([versioned(i, 0, group="g") for i in range(3)])
    dead = subprocess.run([sys.executable, "-c", CLIENT, redis_server.url], capture_output=True, text=True, timeout=60)
    assert dead.returncode == -9, dead.stderr
    assert len(producer) == 0  # the 3 samples are leased to the dead client
    producer.append([versioned(3, 0, group="g")])
    buf = RolloutBuffer(batch_size=4, group_size=4, max_staleness=10, on_stale="drop",
                        storage=RedisStorage(redis_server.url, lease_seconds=1.0))
    batch = buf.get(timeout=10)  # the lease runs out after 1 s: the group is whole again
    assert batch is not None
    assert sorted(s.sample_id for s in batch.samples) == ["s0", "s1", "s2", "s3"]
    time.sleep(1.2)
    assert buf.storage.take(10) == [] and len(buf.storage) == 0  # handed to the trainer: acknowledged, gone for good


def test_the_redis_storage_keeps_the_storage_contract(redis_server: RedisServer) -> None:
    from rlsync.plugins import RedisStorage
    from rlsync.testing import check_storage

    names = iter(range(100))
    check_storage(lambda: RedisStorage(redis_server.url, name=f"conformance-{next(names)}"))


def test_payloads_written_by_a_client_that_died_before_queueing_them_are_never_served(redis_server: RedisServer) -> None:
    """An append is one pipelined round trip: the payloads' HSETs, then the script that queues the ids. A client
    killed in between leaves payloads no id points to: nothing is served from them, and the same samples appended
    again (its retry, or another client) are queued once, with their own bytes."""
    import redis

    from rlsync import encode_sample
    from rlsync.plugins import RedisStorage

    storage = RedisStorage(redis_server.url, name="died")
    orphan, kept = sample(1), sample(2)
    client = redis.Redis.from_url(redis_server.url)
    client.hset(storage._keys["payload"], mapping={orphan.sample_id: encode_sample(orphan), kept.sample_id: b"stale"})
    assert storage.take(10) == [] and len(storage) == 0  # the HSETs alone queue nothing
    storage.append([kept])
    storage.append([kept])  # a retry whose first reply was lost
    taken = storage.take(10)
    assert [s.sample_id for s in taken] == [kept.sample_id] and taken[0].tokens.tolist() == kept.tokens.tolist()
    storage.ack([kept.sample_id])
    assert storage.take(10) == [] and len(storage) == 0


def test_a_url_where_no_redis_answers_is_named_at_once_and_fails_within_the_wait_given(
        caplog: pytest.LogCaptureFixture) -> None:
    """#58: with redis-py but no server, the buffer waited 30 s in silence. Now the first failure is logged at once
    with the URL (its password hidden), and the error after `retry_seconds` names the URL and the options."""
    import socket

    from rlsync import RolloutBufferError

    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="rlsync"), pytest.raises(RolloutBufferError) as raised:
        make_buffer("redis", url=url, batch_size=2, retry_seconds=1.0)
    assert time.monotonic() - started < 3.0
    shown = f"redis://<credentials>@127.0.0.1:{port}/0"
    assert f"no Redis answered at {shown} for 1 s" in str(raised.value) and "url=" in str(raised.value)
    assert [r.getMessage() for r in caplog.records if shown in r.getMessage() and "retrying" in r.getMessage()]
    assert "hunter2" not in str(raised.value) + caplog.text


@pytest.mark.parametrize("url", ["localhost:6379", "http://:hunter2@localhost:6379", "redis://localhost:notaport/0"])
def test_a_url_redis_cannot_take_is_one_line_naming_the_form(url: str) -> None:
    """``make_buffer('redis', url='localhost:6379')`` (issue #70): a ConfigError naming the form, not redis-py's
    traceback, and no password in it."""
    import rlsync
    from rlsync import ConfigError

    with pytest.raises(ConfigError, match=r"url=.*(not a Redis URL|Port).*for example redis://HOST:6379/0") as refused:
        rlsync.make_buffer("redis", url=url)
    assert "hunter2" not in str(refused.value)
