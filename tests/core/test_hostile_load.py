"""Strangers that cost an engine what they send (issue #54): thousands of idle connections and a gigabyte of
unauthenticated frames, sent by the test process at a reader in a process of its own (``_support/flooded_reader.py``,
tcp transport: a control port and a landing port). Judged by what the reader's process pays (its memory, the time of
an honest version) and by honest versions landing bit-exactly through and after the flood."""

from __future__ import annotations

import errno
import json
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import zmq

SCRIPT = str(Path(__file__).parents[1] / "_support" / "flooded_reader.py")
ENVELOPE = struct.Struct("!QQ")


class Reader:
    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([sys.executable, SCRIPT, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)
        self.info = self._line()

    def _line(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the reader process ended (exit {self.process.poll()})"
        return dict(json.loads(line))

    def ask(self, command: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.process.poll() is None:
            self.ask_quietly("quit")
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def ask_quietly(self, command: str) -> None:
        try:
            assert self.process.stdin is not None
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except OSError:
            pass


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` TCP connections to ``port`` that never say a word (non-blocking connects: a full backlog waits)."""
    made = []
    for _ in range(count):
        conn = socket.socket()
        conn.setblocking(False)
        if conn.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            conn.close()
            continue
        made.append(conn)
    return made


def test_idle_connections_neither_exhaust_nor_end_a_tcp_landing() -> None:
    """1,100 idle connections at a tcp landing whose process may hold 256 descriptors. Before: a thread and a
    descriptor each with no timeout, then accept raised EMFILE, the landing's accept thread ended, and every later
    version failed, even after the connections closed. Now a stranger's connection is dropped at its challenge's
    deadline (or when descriptors run out, the oldest first), and versions land through the flood and after it."""
    reader = Reader("--nofile", "256", "--mib", "1")
    flood: list[socket.socket] = []
    try:
        assert reader.ask("land 1 1.0")["exact"]
        flood = idle_connections(reader.info["landing_port"], 1100)
        time.sleep(7)  # past the challenge's deadline (5 s): the reader's side of every idle connection is closed
        landed = reader.ask("land 2 2.0 fresh")  # a new writer: new connections, accepted while the flood is held
        assert landed.get("exact") and landed["version"] == 2, landed
        stats = reader.ask("stats")
        assert stats["landing"]["accept_failures"] or stats["landing"]["turned_away"], stats  # the flood did reach it
        for conn in flood:
            conn.close()
        flood = []
        landed = reader.ask("land 3 3.0 fresh")
        assert landed.get("exact") and landed["version"] == 3, landed
    finally:
        for conn in flood:
            conn.close()
        reader.close()


def test_idle_connections_to_the_control_port_leave_the_engine_its_descriptors() -> None:
    """Issue #66, item 7: 600 idle connections at a reader's control port (ZeroMQ's), in a process that may hold 256
    descriptors and no more (its hard limit too). Before: they took every descriptor of the engine process (its own
    open() then failed) and ZeroMQ's I/O thread spun on accept (19 CPU-s in 30 s). Now strangers hold an eighth of
    the descriptors at most (the oldest is shut down), the engine opens its files, and versions land through the
    flood. (A burst larger than the descriptors left at once still runs them out for that moment: the budget acts
    after ZeroMQ accepts; docs/reliability.md.)"""
    reader = Reader("--nofile", "256", "--hard", "--mib", "1")
    flood: list[socket.socket] = []
    try:
        assert reader.ask("land 1 1.0")["exact"]
        port = int(reader.info["address"].split("#")[0].rsplit(":", 1)[1])
        before = reader.ask("stats")
        for _ in range(6):  # in waves, as a stranger that keeps at it
            flood += idle_connections(port, 100)
            time.sleep(0.5)
        during = reader.ask("stats")
        assert during["opens"], during
        assert during["fds"] <= before["fds"] + 256 // 8 + 8, (before, during)
        assert during["control_turned_away"] > 0, during
        assert during["cpu"] - before["cpu"] < 2.5, (before, during)  # not spinning (3 s of flood)
        landed = reader.ask("land 2 2.0 fresh")  # a new writer: its connection accepted while the flood is held
        assert landed.get("exact") and landed["version"] == 2, landed
    finally:
        for conn in flood:
            conn.close()
    try:
        landed = reader.ask("land 3 3.0 fresh")
        assert landed.get("exact") and landed["version"] == 3, landed
    finally:
        reader.close()


def unauthenticated_frames(address: str, total: int, frame: int, peers: int = 4) -> int:
    """``total`` bytes of frames ``frame`` bytes long at the reader's control port from ``peers`` connections at once,
    unsigned, as a stranger sends them: ZeroMQ's wire protocol by hand (NULL mechanism, a DEALER's READY, then frames
    back to back), reconnecting whenever the reader drops a connection, until every frame was sent or refused.
    Returns the bytes the reader's side took."""
    import threading

    host, port = address.split("#")[0].removeprefix("tcp://").rsplit(":", 1)
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack("!I", 6) + b"DEALER"
    envelope = b"\x01" + bytes([ENVELOPE.size]) + ENVELOPE.pack(0, 0)  # a first frame, more to come
    body = memoryview(bytes(frame))
    taken = [0] * peers

    def send(me: int) -> None:
        frames = total // frame // peers
        while frames > 0:
            with socket.create_connection((host, int(port)), timeout=5) as conn:
                try:
                    conn.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
                    while frames > 0:
                        conn.sendall(envelope + b"\x03" + struct.pack("!Q", frame))  # a long frame, more to come
                        for at in range(0, frame, 1 << 20):
                            taken[me] += conn.send(body[at : at + (1 << 20)])
                        conn.sendall(b"\x00\x20" + bytes(32))  # the last frame: a 32-byte "signature"
                        frames -= 1
                except OSError:
                    frames -= 1  # dropped mid-frame: that frame was refused

    threads = [threading.Thread(target=send, args=(me,)) for me in range(peers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(taken)


def test_a_gigabyte_of_unauthenticated_frames_and_5000_idle_connections_cost_the_engine_little() -> None:
    """#54's done-when: with 1 GiB of unauthenticated frames and 5,000 idle connections sent at a reader, an honest
    version lands within twice its usual time and the engine's memory grows by less than 200 MB. Before: 12 frames of
    128 MiB took an engine from 0.27 to 1.84 GB and an honest version from 0.01 s to 0.8-7.7 s. The frames here are
    60 MiB each (under the bound this reader's layout sets, 64 MiB), sent on ZeroMQ's wire protocol by a peer without
    the key: each connection is dropped at its greeting (CURVE), before a frame is read."""
    reader = Reader("--mib", "32")
    flood: list[socket.socket] = []
    try:
        usual = statistics.median(reader.ask(f"land {v} {v}.0")["seconds"] for v in range(1, 5))
        before = reader.ask("reset")["rss"]
        address, port = reader.info["address"], int(reader.info["address"].split("#")[0].rsplit(":", 1)[1])
        flood = idle_connections(port, 2500) + idle_connections(reader.info["landing_port"], 2500)
        assert len(flood) == 5000
        taken = unauthenticated_frames(address, 1 << 30, 60 << 20)
        time.sleep(0.5)
        landed = [reader.ask(f"land {v} {v}.0") for v in range(5, 8)]
        stats = reader.ask("stats")
        attacked = statistics.median(one["seconds"] for one in landed)
        grown = (stats["peak"] - before) / 2**20
        print(f"\nan honest 32 MiB version: {usual * 1000:.1f} ms usually, {attacked * 1000:.1f} ms after 1 GiB of "
              f"unauthenticated frames with 5,000 idle connections held; the reader's peak RSS grew {grown:.0f} MiB; "
              f"of the 1 GiB of frames the reader's side took {taken / 2**20:.0f} MiB before it dropped them; "
              f"rejected {stats['rejected']}; landing: {stats['landing']}")
        assert all(one.get("exact") for one in landed), landed
        assert stats["rejected"] >= 4, stats  # a failed handshake each (at least)
        assert grown < 200, f"the reader's memory grew {grown:.0f} MiB"
        assert attacked < 2 * usual + 0.02, f"an honest version took {attacked:.3f} s, {usual:.3f} s usually"
    finally:
        for conn in flood:
            conn.close()
        reader.close()
