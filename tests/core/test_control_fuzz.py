"""Hostile input on the control plane: every control message type, fuzzed (hypothesis), sent to a live reader from a
peer that is not an rlsync writer. Well-formed frames of every type with wrong field types, unknown fields, huge
numbers (versions, slots, ranks, byte counts a frame merely claims), random bytes and wrong frame counts. The
reader answers each with a refusal or drops it, its memory does not grow by what the frames claim, and afterwards a
real writer's version lands and serves. A raw ZeroMQ peer whose frame header claims gigabytes is dropped at the header.
Then the same with coverage-guided fuzzing (atheris: ``tests/fuzz/control_atheris.py``)."""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlsync import ConfigError, StagedReceiver, SyncOptions, WeightsWriter
from rlsync.layouts import from_state_dict

TENSORS = [["model.embed_tokens.weight", "float32", [16, 8]], ["model.norm.weight", "float32", [8]]]
STATE = {"model.embed_tokens.weight": torch.randn(16, 8), "model.norm.weight": torch.randn(8)}
TYPES = ["Hello", "AskLayout", "LayoutIs", "Welcome", "Refuse", "Done", "Ack", "Begin", "Go", "Nonsense"]
EXAMPLES = 150  # per message type

huge = st.sampled_from([2**31, 2**40, 2**63 - 1, -(2**63), -1, 0])
value: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | huge | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["writer_rank", "src_fingerprint", "dst_fingerprint", "dst_tensors", "session", "src", "delta", "checksums",
          "layout", "live_version", "reader_rank", "transport", "description", "next_slot", "inbox", "inbox_offset",
          "inbox_capacity", "reason", "kind", "version", "slot", "delta_base", "delta_nbytes", "canary", "digest"]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(scope="module")
def receiver() -> Any:
    with StagedReceiver(TENSORS, options=SyncOptions(timeout=30)) as made:
        yield made


@pytest.fixture(scope="module")
def peer(receiver: StagedReceiver) -> Any:
    sock = zmq.Context.instance().socket(zmq.DEALER)  # a process on the reader's host, not an rlsync writer
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.address)
    yield sock
    sock.close()


@pytest.mark.parametrize("kind", TYPES)
def test_every_message_type_fuzzed_is_refused_or_dropped(kind: str, receiver: StagedReceiver, peer: Any) -> None:
    before = _peak_rss_mb()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(fields=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), value, max_size=8),
           shape=st.sampled_from(["message", "message", "bytes", "one-frame", "four-frames"]))
    def send(fields: dict[str, Any], shape: str) -> None:
        payload = msgspec.msgpack.encode({"type": kind, **fields})
        frames = {"message": [payload, b""], "bytes": [bytes(fields.get("session", b"\x00garbage"), "utf-8")
                                                        if isinstance(fields.get("session"), str) else b"\xc1\xff", b""],
                  "one-frame": [payload], "four-frames": [payload, b"", b"", b""]}[shape]
        peer.send_multipart(frames)

    send()
    time.sleep(0.5)  # the reader's thread has taken them all
    assert _peak_rss_mb() - before < 256, "the reader allocated what hostile frames claimed"
    assert receiver.reader._thread.is_alive()  # type: ignore[attr-defined]


def test_after_the_fuzzing_a_real_writer_still_lands_a_version(receiver: StagedReceiver) -> None:
    writer = WeightsWriter(from_state_dict(STATE), None, 0, [receiver.address], options=SyncOptions(timeout=30))
    try:
        writer.multi_put(STATE)
        got: dict[str, Any] = {}

        def engine() -> None:
            version, views, finish = receiver.next(30)
            got.update(version=version, views={n: t.clone() for n, t in views})
            finish(None)

        thread = threading.Thread(target=engine)
        thread.start()
        writer.complete(max(1, writer.next_version))
        thread.join(30)
        assert torch.equal(got["views"]["model.norm.weight"].view(torch.float32), STATE["model.norm.weight"])
    finally:
        writer.close()



def _zmtp_peer(address: str) -> socket.socket:
    """A raw TCP peer that speaks ZeroMQ's wire protocol (ZMTP 3.0, NULL mechanism) up to its first message frame."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
    greeting = b""
    while len(greeting) < 64:
        greeting += conn.recv(64 - len(greeting))
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack("!I", 6) + b"DEALER"
    conn.sendall(b"\x04" + bytes([len(ready)]) + ready)
    return conn


@pytest.mark.parametrize("claimed", [2**31, 2**40, 2**62])
def test_a_frame_that_claims_more_than_the_bound_drops_its_peer_at_the_header(receiver: StagedReceiver,
                                                                             claimed: int) -> None:
    conn = _zmtp_peer(receiver.address)
    try:
        conn.sendall(b"\x02" + struct.pack("!Q", claimed) + b"x" * 64)  # a long frame's header, then a trickle
        before = _peak_rss_mb()
        conn.settimeout(5)
        dropped = b""
        try:
            while chunk := conn.recv(4096):  # the reader's READY, then the end of the connection
                dropped += chunk
        except TimeoutError:
            pytest.fail(f"a peer claiming a {claimed}-byte frame was still connected after 5 s (no bound: ZeroMQ "
                        f"allocated the claim and waits for the bytes)")
        assert _peak_rss_mb() - before < 64
    finally:
        conn.close()
    assert receiver.reader._thread.is_alive()  # type: ignore[attr-defined]
    test_after_the_fuzzing_a_real_writer_still_lands_a_version(receiver)


def test_a_message_over_the_bound_is_refused_by_its_sender_naming_the_setting(receiver: StagedReceiver,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLSYNC_MAX_CONTROL_BYTES", "200")  # the writer's Hello carries its layout: longer than this
    with pytest.raises(ConfigError, match="control message of .* RLSYNC_MAX_CONTROL_BYTES=200: raise it"):
        writer = WeightsWriter(from_state_dict(STATE), None, 0, [receiver.address], options=SyncOptions(timeout=5))
        try:
            writer.multi_put(STATE)
            writer.complete(writer.next_version)
        finally:
            writer.close()


ATHERIS_RUNS = 20000


def test_coverage_guided_fuzzing_with_atheris_finds_no_crash_hang_or_unbounded_allocation(tmp_path: Path) -> None:
    pytest.importorskip("atheris")
    counts = tmp_path / "counts.json"
    done = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "fuzz" / "control_atheris.py"),
                           f"-runs={ATHERIS_RUNS}", "-rss_limit_mb=1024", "-timeout=20", "-seed=1",
                           f"-artifact_prefix={tmp_path}/"],
                          env={**os.environ, "RLSYNC_FUZZ_COUNTS": str(counts)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(counts.read_text())  # inputs per message type, and how many of them decoded (reached a handler)
    assert sum(seen["inputs"].values()) == ATHERIS_RUNS and min(seen["inputs"].values()) >= 200, seen
    assert all(seen["handled"][kind] >= 20 for kind in TYPES if kind not in ("LayoutIs", "Nonsense")), seen
