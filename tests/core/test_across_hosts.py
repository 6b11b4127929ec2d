"""Weights across hosts: a trainer and an engine reader on two test hosts (network namespaces on one virtual
switch, ``tests/_support/netns_hosts.py``), over tcp on non-loopback addresses. With the shared secret every version
lands exactly; without it the reader will not listen; with another one the writer is refused before a byte of
weights moves, both sides naming the setting; a partition in the middle of a version leaves the reader on the
previous version and fails the writer within its timeout, and once the link heals the next version lands with no
restart. Skipped, with the reason, where namespaces cannot be made (not root, no iproute2)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _support.netns_hosts import TestHosts, faults_unavailable, unavailable

pytestmark = pytest.mark.slow
SCRIPT = str(Path(__file__).parents[1] / "_support" / "sync_processes.py")
SECRET = "rlsync-test-secret-" + "x" * 16


@pytest.fixture
def hosts() -> Iterator[TestHosts]:
    why = unavailable()
    if why:
        pytest.skip(f"no test hosts on this machine: {why}")
    made = TestHosts(2)
    yield made
    made.close()


class Peer:
    """A script on a test host (``script``: the sync peers by default); its JSON reports are read as they come (a
    thread per peer)."""

    def __init__(self, hosts: TestHosts, host: int, args: list[str], secret: str | None, script: str = SCRIPT) -> None:
        env = {k: v for k, v in os.environ.items() if k != "RLSYNC_SECRET"}
        # NIXL's UCX would take shared memory between namespaces of one kernel: TCP, as between real hosts
        env["UCX_TLS"] = "tcp"
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
        if secret is not None:
            env["RLSYNC_SECRET"] = secret
        self.process = hosts.popen(host, [sys.executable, script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env=env)
        self.reports: list[dict[str, Any]] = []
        self.ended = False
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(json.loads(line))
        self._lines.put(None)  # the peer ended

    def _until(self, deadline: float) -> Iterator[dict[str, Any]]:
        """Reports as they come, until ``deadline`` or the peer's end (``ended``)."""
        while not self.ended and (left := deadline - time.monotonic()) > 0:
            try:
                report = self._lines.get(timeout=left)
            except queue.Empty:
                return
            if report is None:
                self.ended = True
                return
            self.reports.append(report)
            yield report

    def next(self, key: str, timeout: float = 60.0) -> dict[str, Any]:
        """The next report that has ``key``."""
        for report in self._until(time.monotonic() + timeout):
            if key in report:
                return report
        if self.ended:
            err = self.process.stderr.read() if self.process.stderr else ""
            raise AssertionError(f"the peer ended without reporting {key!r}: {self.reports}\n{err[-3000:]}")
        raise AssertionError(f"no report with {key!r} within {timeout} s: {self.reports}")

    def drain(self, seconds: float) -> list[dict[str, Any]]:
        """Every report so far, waiting ``seconds`` for more."""
        for _ in self._until(time.monotonic() + seconds):
            pass
        return self.reports


def _reader(hosts: TestHosts, secret: str | None, seconds: float = 90.0, transport: str = "tcp",
            layout: str = "plain") -> Peer:
    return Peer(hosts, 1, ["reader", "--transport", transport, "--host", hosts.addresses[1], "--check",
                           "--timeout", str(seconds), "--layout", layout], secret)


def _writer(hosts: TestHosts, address: str, versions: list[int], secret: str | None, *extra: str,
            transport: str = "tcp") -> Peer:
    return Peer(hosts, 0, ["writer", "--transport", transport, "--readers", json.dumps({"0": address}), "--versions",
                           *map(str, versions), *extra], secret)


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_versions_land_exactly_across_hosts_with_the_shared_secret(hosts: TestHosts, transport: str) -> None:
    if transport == "nixl":
        pytest.importorskip("nixl")
    reader = _reader(hosts, SECRET, transport=transport)
    address = reader.next("address")["address"]
    assert hosts.addresses[1] in address  # a real address of the reader's host, not loopback
    writer = _writer(hosts, address, [1, 2, 3], SECRET, "--timeout", "30", transport=transport)
    for version in (1, 2, 3):
        assert writer.next("completed")["completed"] == version
    landed = [r for r in reader.reports if "version" in r]
    while not any(r.get("version") == 3 for r in landed):
        landed.append(reader.next("version"))
    assert all(r["exact"] for r in landed if r["version"] > 0), landed


@pytest.mark.parametrize("transport", ["tcp", pytest.param("nixl", marks=pytest.mark.nixl)])
def test_versions_land_exactly_over_100_ms_latency_and_1_percent_loss(hosts: TestHosts, transport: str) -> None:
    """Every byte the trainer's host sends reaches the engine's host 100 ms later and every answer comes back 100 ms
    later (a relay); 1 % of the packets each host sends are dropped (nftables). 32 MiB versions land exactly; the
    seconds per version are printed (docs/reliability.md)."""
    why = faults_unavailable()
    if why:
        pytest.skip(why)
    if transport == "nixl":
        pytest.importorskip("nixl")
    hosts.delay(0, 0.1)
    hosts.lossy(0, 1.0)
    hosts.lossy(1, 1.0)
    reader = _reader(hosts, SECRET, seconds=300, transport=transport, layout="large")
    address = reader.next("address")["address"]
    writer = _writer(hosts, address, [1, 2, 3], SECRET, "--timeout", "120", "--layout", "large", transport=transport)
    seconds = []
    for version in (1, 2, 3):
        completed = writer.next("completed", timeout=240)
        assert completed["completed"] == version
        seconds.append(round(completed["with_put"], 2))  # multi_put and complete: the whole version
    landed = [r for r in reader.reports if "version" in r]
    while not any(r.get("version") == 3 for r in landed):
        landed.append(reader.next("version", timeout=120))
    assert all(r["exact"] for r in landed if r["version"] > 0), landed
    assert min(seconds) >= 0.2, seconds  # at least one round trip through the relay: the latency was on the path
    dropped = hosts.dropped(0) + hosts.dropped(1)
    assert dropped > 0, "no packet was lost: the loss rule was not on the path"
    print(f"\n{transport}: 32 MiB per version, 100 ms each way, 1 % loss ({dropped} packets dropped): "
          f"seconds per version {seconds}")


def test_without_the_secret_nothing_listens_and_another_secret_is_refused_before_any_byte(hosts: TestHosts) -> None:
    alone = _reader(hosts, None)
    assert "RLSYNC_SECRET" in alone.next("error")["error"] or "secret" in alone.reports[-1]["error"]
    reader = _reader(hosts, SECRET)
    address = reader.next("address")["address"]
    writer = _writer(hosts, address, [1], "another-secret-of-the-same-length!", "--timeout", "10")
    failed = writer.next("failed")
    assert "secret" in failed["error"], failed
    refused = reader.next("refused")["refused"]
    assert refused and "secret" in refused, reader.reports
    assert not any(r.get("version", 0) > 0 for r in reader.reports)  # no version landed, nothing partly


def test_a_partition_mid_version_keeps_the_old_version_and_the_next_lands_after_it_heals(hosts: TestHosts,
                                                                                       tmp_path: Path) -> None:
    gate = str(tmp_path / "go")
    reader = _reader(hosts, SECRET, seconds=120)
    address = reader.next("address")["address"]
    writer = _writer(hosts, address, [1, 2, 3], SECRET, "--timeout", "8", "--keep-going", "--wait-for", gate)
    Path(f"{gate}.1").touch()
    assert writer.next("completed")["completed"] == 1
    assert writer.next("put")["put"] == 2  # version 2's bytes are put: the link goes down before it completes
    hosts.cut(1)
    Path(f"{gate}.2").touch()
    failed = writer.next("failed", timeout=60)
    assert failed["failed"] == 2 and failed["seconds"] < 8 + 5, failed  # within its timeout
    seen = [r["version"] for r in reader.drain(2.0) if "version" in r]
    assert seen[-1] == 1 and 2 not in seen, reader.reports  # the reader never served version 2, nor a mix
    hosts.heal(1)
    assert writer.next("put")["put"] == 3
    Path(f"{gate}.3").touch()
    assert writer.next("completed", timeout=60)["completed"] == 3  # no restart of either side
    landed = reader.next("version")
    while landed["version"] != 3:
        landed = reader.next("version")
    assert all(r["exact"] for r in reader.reports if r.get("version", 0) > 0), reader.reports


def test_a_reader_host_that_disappears_fails_the_version_there_only(tmp_path: Path) -> None:
    """Two engines (replicas) on two hosts, the writer on a third; one engine's host drops off the network while a
    version is sent. What rlsync does (documented in docs/reliability.md): the version goes live on every engine
    that got all of it, and the writer's ``complete`` raises within its timeout, naming the engine that did not and
    where it is live. Back on the network, the next version reaches both engines again."""
    why = unavailable()
    if why:
        pytest.skip(f"no test hosts on this machine: {why}")
    hosts = TestHosts(3)
    gate = str(tmp_path / "go")
    try:
        readers = [Peer(hosts, h, ["reader", "--transport", "tcp", "--host", hosts.addresses[h], "--check", "--replicas", "2",
                                   "--rank", str(h - 1), "--timeout", "120"], SECRET) for h in (1, 2)]
        addresses = {str(i): r.next("address")["address"] for i, r in enumerate(readers)}
        writer = Peer(hosts, 0, ["writer", "--transport", "tcp", "--replicas", "2", "--readers", json.dumps(addresses),
                                 "--versions", "1", "2", "3", "--timeout", "8", "--keep-going", "--wait-for", gate], SECRET)
        Path(f"{gate}.1").touch()
        assert writer.next("completed")["completed"] == 1
        assert writer.next("put")["put"] == 2
        hosts.cut(2)  # engine rank 1's host is gone
        Path(f"{gate}.2").touch()
        failed = writer.next("failed", timeout=60)
        assert failed["failed"] == 2 and failed["seconds"] < 8 + 5, failed
        assert "reader rank 1" in failed["error"] and "Live on reader ranks [0]" in failed["error"], failed
        landed = readers[0].next("version")
        while landed["version"] != 2:
            landed = readers[0].next("version")
        assert landed["exact"]  # the engine still on the network serves version 2, exactly
        assert 2 not in [r["version"] for r in readers[1].drain(1.0) if "version" in r]
        hosts.heal(2)
        assert writer.next("put")["put"] == 3
        Path(f"{gate}.3").touch()
        assert writer.next("completed", timeout=60)["completed"] == 3  # both engines again
        for reader in readers:
            landed = reader.next("version")
            while landed["version"] != 3:
                landed = reader.next("version")
            assert landed["exact"]
    finally:
        hosts.close()


BUFFER = str(Path(__file__).parents[1] / "_support" / "buffer_peers.py")


@pytest.mark.redis
def test_the_redis_buffer_on_its_own_host_loses_and_repeats_nothing_across_a_partition(tmp_path: Path) -> None:
    """Redis on host 2, a generator on host 0 and a trainer on host 1; the generator's host is cut off for 3 s in the
    middle of its puts. Its put blocks (retrying) and goes on after the heal; the trainer gets every sample once.
    A partition longer than the buffer's retry window raises ``RolloutBufferError`` naming Redis, and nothing the
    generator put before it is lost."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian package 'redis-server')")
    why = unavailable()
    if why:
        pytest.skip(f"no test hosts on this machine: {why}")
    hosts = TestHosts(3)
    try:
        hosts.popen(2, ["redis-server", "--port", "6390", "--bind", hosts.addresses[2], "--protected-mode", "no",
                        "--dir", str(tmp_path), "--save", "", "--appendonly", "no", "--daemonize", "no"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://{hosts.addresses[2]}:6390/0"
        time.sleep(1.0)
        total = 400
        producer = _buffer_peer(hosts, 0, ["produce", url, str(total)])
        consumer = _buffer_peer(hosts, 1, ["consume", url, str(total)])
        producer.next("put", timeout=60)
        while producer.next("put", timeout=60)["put"] < 100:
            pass
        hosts.cut(0)  # the generator's host loses the network mid-stream
        time.sleep(3.0)
        hosts.heal(0)
        done = producer.next("produced", timeout=120)
        assert done["longest_put"] > 2.0  # it waited out the partition (retrying), then went on
        got = consumer.next("got", timeout=120)["got"]
        assert len(got) == len(set(got)) == total and set(got) == {f"s{i}" for i in range(total)}

        # a partition longer than the retry window: the client hears it, by name
        short = _buffer_peer(hosts, 0, ["produce", url, "200", "--retry", "2", "--first", "1000"])
        while short.next("put", timeout=60)["put"] < 50:
            pass
        hosts.cut(0)
        error = short.next("error", timeout=60)["error"]
        assert "RolloutBufferError" in error and "no Redis answered at redis://" in error, error
        hosts.heal(0)
        put = max(r["put"] for r in short.reports if "put" in r)
        drain = _buffer_peer(hosts, 1, ["consume", url, str(put)])
        got = drain.next("got", timeout=120)["got"]
        assert len(got) == len(set(got)) == put  # everything acknowledged before the cut is there, once
        assert set(got) == {f"s{1000 + i}" for i in range(put)}
    finally:
        hosts.close()


def _buffer_peer(hosts: TestHosts, host: int, args: list[str]) -> Peer:
    return Peer(hosts, host, args, None, script=BUFFER)
