"""Hostile input on the control plane: every control message type, fuzzed (hypothesis), sent to a live reader from a
peer that is not an rlsync writer. Well-formed frames of every type with wrong field types, unknown fields, huge
numbers (versions, slots, ranks, byte counts a frame merely claims), random bytes and wrong frame counts, signed with
the reader's key (an insider: what reaches the decoder and the handlers) and not (an outsider: refused at the
signature). Then byte-level mutations of valid messages (truncation, bit flips, invalid UTF-8, deep nesting, msgpack
extension types, oversized containers) and well-formed messages out of session, in a made-up session, and replayed
from an honest writer's session. The reader answers each with a refusal or drops it, its memory does not grow by
what the frames claim, it answers a probe after each batch, and afterwards a real writer's version lands and serves.
A raw ZeroMQ peer whose frame header claims gigabytes is dropped at the header. Then the same with coverage-guided
fuzzing (atheris: ``tests/fuzz/control_atheris.py``)."""

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

from _support.insider import ENVELOPE, Insider
from rlsync import ConfigError, StagedReceiver, SyncOptions, WeightsWriter
from rlsync.layouts import from_state_dict

TENSORS = [["model.embed_tokens.weight", "float32", [16, 8]], ["model.norm.weight", "float32", [8]]]
STATE = {"model.embed_tokens.weight": torch.randn(16, 8), "model.norm.weight": torch.randn(8)}
TYPES = ["Knock", "Challenge", "Hello", "AskLayout", "LayoutIs", "Welcome", "Refuse", "Done", "Ack", "Begin", "Go", "Nonsense"]
EXAMPLES = 150  # per message type

huge = st.sampled_from([2**31, 2**40, 2**63 - 1, -(2**63), -1, 0])
value: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | huge | st.floats(allow_nan=True) | st.text(max_size=20) | st.binary(max_size=64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
FIELDS = ["writer_rank", "src_fingerprint", "dst_fingerprint", "dst_tensors", "session", "src", "delta", "checksums",
          "layout", "live_version", "reader_rank", "transport", "description", "next_slot", "inbox", "inbox_offset",
          "inbox_capacity", "reason", "kind", "version", "slot", "delta_base", "delta_nbytes", "canary", "digest", "nonce",
          "needs_src", "max_bytes"]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture(scope="module")
def receiver() -> Any:
    with StagedReceiver(TENSORS, options=SyncOptions(timeout=30)) as made:
        yield made


@pytest.fixture(scope="module")
def peer(receiver: StagedReceiver) -> Any:
    made = Insider(receiver.address)  # a process on the reader's host holding its key, not an rlsync writer
    yield made
    made.close()


def probe_answers(receiver: StagedReceiver, peer: Insider) -> None:
    """The reader answers a layout request (after whatever came before it on this peer's connection)."""
    while peer.sock.poll(200):  # answers to earlier inputs (a fuzzed AskLayout's LayoutIs among them) are not the probe's
        peer.sock.recv_multipart()
    try:
        peer.knock()
    except TimeoutError:
        pytest.fail("the reader did not answer a Knock after the fuzzed input")
    peer.send({"type": "AskLayout"})
    answer = peer.answer()
    if answer is None or answer["type"] != "LayoutIs":
        pytest.fail(f"the reader did not answer a layout request after the fuzzed input: {answer}")


@pytest.mark.parametrize("kind", TYPES)
def test_every_message_type_fuzzed_is_refused_or_dropped(kind: str, receiver: StagedReceiver, peer: Any) -> None:
    before = _peak_rss_mb()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(fields=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), value, max_size=8),
           shape=st.sampled_from(["in-session", "in-session", "in-session-bytes", "before-session", "unsigned",
                                  "one-frame", "four-frames"]))
    def send(fields: dict[str, Any], shape: str) -> None:
        payload = msgspec.msgpack.encode({"type": kind, **fields})
        if shape.startswith("in-session"):  # a fresh session each: a Hello or AskLayout reaches its handler there
            peer.knock()
        frames = {"in-session": lambda: peer.in_session(payload),
                  "in-session-bytes": lambda: peer.in_session(payload[: len(payload) // 2] + b"\xc1\xff"),
                  "before-session": lambda: peer.pre_session(payload), "unsigned": lambda: [ENVELOPE.pack(0, 0), payload, b""],
                  "one-frame": lambda: [payload], "four-frames": lambda: [payload, b"", b"", b""]}[shape]()
        peer.sock.send_multipart(frames)

    send()
    probe_answers(receiver, peer)
    assert _peak_rss_mb() - before < 256, "the reader allocated what hostile frames claimed"
    assert receiver.reader._thread.is_alive()  # type: ignore[attr-defined]


def _valid_messages(receiver: StagedReceiver) -> list[bytes]:
    layout = from_state_dict(STATE)
    hello = {"type": "Hello", "writer_rank": 0, "src_fingerprint": layout.fingerprint(), "dst_fingerprint": "",
             "dst_tensors": {}, "session": "fuzz", "src": msgspec.to_builtins(layout)}
    return [msgspec.msgpack.encode(m) for m in (
        hello, {"type": "AskLayout", "src": msgspec.to_builtins(layout)}, {"type": "Knock", "nonce": b"k" * 16},
        {"type": "Done", "writer_rank": 0, "version": 7, "slot": 0, "checksums": {"w": 1}},
        {"type": "Begin", "writer_rank": 0, "version": 7})]


def _mutate(payload: bytes, how: str, at: int, byte: int) -> bytes:
    at %= max(len(payload), 1)
    if how == "truncate":
        return payload[:at]
    if how == "flip":
        return payload[:at] + bytes([payload[at] ^ (1 << (byte % 8))]) + payload[at + 1 :] if payload else payload
    if how == "not-utf8":  # a str of two bytes that are not UTF-8 where the string "type" was
        return payload.replace(b"\xa4type", b"\xa4type\xa2\xff\xfe", 1)
    if how == "deep":  # thousands of nested one-element lists in an unknown field
        return payload[:1] + b"\xa1z" + b"\x91" * 20000 + b"\xc0" + payload[1:] if payload[:1] in (b"\x81", b"\x82", b"\x83", b"\x84", b"\x85") else payload
    if how == "ext":  # a msgpack extension type inserted
        return payload[:at] + b"\xd4\x05\x01" + payload[at:]
    if how == "oversized":  # a container that claims 2^32-1 elements
        return payload[:at] + b"\xdd\xff\xff\xff\xff" + payload[at:]
    return bytes([byte]) * at


MUTATIONS = ["truncate", "flip", "not-utf8", "deep", "ext", "oversized", "noise"]


def test_byte_level_mutations_of_valid_messages_are_refused_and_the_reader_goes_on(receiver: StagedReceiver, peer: Insider) -> None:
    messages = _valid_messages(receiver)
    before = _peak_rss_mb()

    @settings(max_examples=EXAMPLES * 2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(which=st.integers(0, len(messages) - 1), how=st.sampled_from(MUTATIONS), at=st.integers(0, 4096),
           byte=st.integers(0, 255), session=st.sampled_from(["own", "none", "made-up"]), insider=st.booleans())
    def send(which: int, how: str, at: int, byte: int, session: str, insider: bool) -> None:
        payload = _mutate(messages[which], how, at, byte)
        if not insider:
            frames = [ENVELOPE.pack({"own": peer.session, "none": 0, "made-up": 2**63 - 1}[session], 1), payload, b"x" * 32]
        elif session == "none":
            frames = peer.pre_session(payload)
        else:
            peer.knock()
            if session == "made-up":
                peer.session = 2**63 - 1
            frames = peer.in_session(payload)
        peer.sock.send_multipart(frames)

    send()
    probe_answers(receiver, peer)
    assert _peak_rss_mb() - before < 256 and receiver.reader._thread.is_alive()  # type: ignore[attr-defined]


def test_framing_mutations_are_refused_and_the_reader_goes_on(receiver: StagedReceiver, peer: Insider) -> None:
    """Frames as a key holder sends them, mutated at the framing level: short or long envelopes, sessions unknown, its
    own or another peer's, counters at the edges, signatures cut or padded, frames missing or extra."""
    other = Insider(receiver.address)
    other.knock()
    messages = [msgspec.msgpack.encode(m) for m in ({"type": "AskLayout"}, {"type": "Begin", "writer_rank": 0, "version": 9},
                                                     {"type": "Knock", "nonce": b"k" * 16})]
    before = _peak_rss_mb()

    @settings(max_examples=EXAMPLES * 2, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(which=st.integers(0, len(messages) - 1), envelope=st.integers(0, 24), session=st.sampled_from(["own", "other", "none", "made-up"]),
           counter=st.sampled_from([0, 1, 2**64 - 1, "last", "next"]), mac=st.sampled_from([0, 31, 32, 33, 64, 65, "right"]),
           before_frames=st.integers(0, 2), after_frames=st.integers(0, 2), knock=st.booleans())
    def send(which: int, envelope: int, session: str, counter: Any, mac: Any, before_frames: int, after_frames: int,
             knock: bool) -> None:
        if knock:
            peer.knock()
        sid = {"own": peer.session, "other": other.session, "none": 0, "made-up": 2**63 - 1}[session]
        number = {"last": peer.counter, "next": peer.counter + 1}.get(counter, counter)
        if session == "own" and mac == "right":  # signed rightly in its own session (the counter may still be off)
            frames = peer.in_session(messages[which], counter=max(0, min(number, 2**64 - 1)))
        else:
            head = ENVELOPE.pack(sid, max(0, min(number, 2**64 - 1)))
            frames = [head, messages[which], bytes(32 if mac == "right" else mac)]
        frames[0] = (frames[0] + bytes(24))[:envelope] if envelope != ENVELOPE.size else frames[0]
        peer.sock.send_multipart([b"x"] * before_frames + frames + [b"y" * 40] * after_frames)

    send()
    probe_answers(receiver, peer)
    other.close()
    assert _peak_rss_mb() - before < 256 and receiver.reader._thread.is_alive()  # type: ignore[attr-defined]


def test_connections_half_open_slow_and_many_leave_the_reader_serving(receiver: StagedReceiver, peer: Insider) -> None:
    """Connection-level abuse of the control port: 100 connections that greet halfway and go silent, 8 that trickle
    their greeting a byte at a time, 300 key holders that Knock and never say more (each opens a session: the table
    is bounded), then 300 that connect and close at once. The reader answers a probe and a writer lands a version."""
    import threading

    host, port = receiver.address.split("#")[0].removeprefix("tcp://").rsplit(":", 1)
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32
    half_open = []
    for _ in range(100):
        conn = socket.create_connection((host, int(port)), timeout=5)
        conn.sendall(greeting[:30])
        half_open.append(conn)

    def trickle() -> None:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            try:
                for byte in greeting:
                    conn.sendall(bytes([byte]))
                    time.sleep(0.02)
            except OSError:
                pass

    slow = [threading.Thread(target=trickle) for _ in range(8)]
    for thread in slow:
        thread.start()
    knocking = [Insider(receiver.address) for _ in range(300)]
    for one in knocking:
        one.knock()
    for _ in range(300):
        socket.create_connection((host, int(port)), timeout=5).close()
    probe_answers(receiver, peer)
    for one in knocking:
        one.close()
    for conn in half_open:
        conn.close()
    for thread in slow:
        thread.join()
    assert receiver.reader._thread.is_alive()  # type: ignore[attr-defined]
    test_after_the_fuzzing_a_real_writer_still_lands_a_version(receiver)


def test_an_honest_sessions_messages_replayed_from_another_peer_are_refused(receiver: StagedReceiver, peer: Insider,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer's session recorded on the wire, then sent again, from another connection and from its own order."""
    sent: list[list[bytes]] = []
    original = zmq.Socket.send_multipart

    def record(sock: Any, frames: Any, *args: Any, **kwargs: Any) -> Any:
        if sock.type == zmq.DEALER and sock is not peer.sock:
            sent.append([bytes(f) for f in frames])
        return original(sock, frames, *args, **kwargs)

    monkeypatch.setattr(zmq.Socket, "send_multipart", record)
    test_after_the_fuzzing_a_real_writer_still_lands_a_version(receiver)
    monkeypatch.undo()
    assert any(len(frames) == 3 and b"Done" in frames[1] for frames in sent), sent
    live, rejected = receiver.reader.version, receiver.reader.rejected
    for frames in sent:
        peer.sock.send_multipart(frames)
    deadline = time.monotonic() + 10
    while receiver.reader.rejected < rejected + len(sent) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert receiver.reader.rejected == rejected + len(sent)  # every replayed Knock, Hello, AskLayout and Done refused
    assert receiver.reader.version == live


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



def _zmtp_greeting(address: str, mechanism: bytes) -> socket.socket:
    """A raw TCP peer that opens ZeroMQ's wire protocol (ZMTP 3.0) by hand with ``mechanism``."""
    host, port = address.split("#")[0].removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
    return conn


@pytest.mark.parametrize("claimed", [2**27, 2**31, 2**40, 2**62])
def test_a_stranger_speaking_zeromq_by_hand_is_dropped_at_its_greeting(receiver: StagedReceiver, claimed: int) -> None:
    """A peer without the key cannot get a frame to the reader at all (the control socket speaks CURVE): one that
    greets with ZeroMQ's NULL mechanism and then claims a frame of ``claimed`` bytes is dropped at the greeting, and
    the reader allocates nothing for it. (Before CURVE, ZeroMQ allocated the claim up to the bound.)"""
    conn = _zmtp_greeting(receiver.address, b"NULL")
    before = _peak_rss_mb()
    try:
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack("!I", 6) + b"DEALER"
        conn.sendall(b"\x04" + bytes([len(ready)]) + ready + b"\x02" + struct.pack("!Q", claimed) + b"x" * 64)
    except OSError:
        pass  # already dropped
    conn.settimeout(5)
    try:
        while conn.recv(4096):  # the reader's greeting, then the end of the connection
            pass
    except TimeoutError:
        pytest.fail("a stranger greeting with the NULL mechanism was still connected after 5 s")
    except OSError:
        pass  # reset: dropped
    finally:
        conn.close()
    assert _peak_rss_mb() - before < 64
    assert receiver.reader._thread.is_alive()  # type: ignore[attr-defined]


def test_a_key_holders_message_over_the_bound_drops_its_connection_unread(receiver: StagedReceiver) -> None:
    """The reader's bound (from its layout: 64 MiB for this small one) holds for key holders too: a 128 MiB message
    drops the connection that sent it at its header; the reader goes on and the next writer lands a version."""
    assert receiver.reader._bound == 64 << 20  # type: ignore[attr-defined]
    insider = Insider(receiver.address)
    insider.knock()
    insider.sock.send_multipart(insider.in_session(bytes(128 << 20)))
    insider.send({"type": "AskLayout"})  # never read: the connection is gone
    assert insider.answer(2000) is None
    insider.close()
    assert receiver.reader._thread.is_alive()  # type: ignore[attr-defined]
    test_after_the_fuzzing_a_real_writer_still_lands_a_version(receiver)


def test_a_message_over_the_bound_is_refused_by_its_sender_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader tells a writer the longest message it takes (its Challenge); a writer whose Hello is longer hears it
    at once, naming the setting, instead of being dropped at the header without a word."""
    many = [[f"layer.{i}.weight", "float32", [4]] for i in range(500)]  # a Hello of about 50 KB (the layout in it)
    monkeypatch.setenv("RLSYNC_MAX_CONTROL_BYTES", str(16 << 10))  # the engine's: its bound, below the writer's Hello
    with StagedReceiver(many, options=SyncOptions(timeout=30)) as small:
        monkeypatch.delenv("RLSYNC_MAX_CONTROL_BYTES")
        state = {name: torch.zeros(4) for name, _, _ in many}
        with pytest.raises(ConfigError, match="control message of .* longer than the 16384 .* RLSYNC_MAX_CONTROL_BYTES"):
            writer = WeightsWriter(from_state_dict(state), small.reader.dst, 0, [small.address], options=SyncOptions(timeout=5))
            try:
                writer.multi_put(state)
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
    assert all(seen["handled"][kind] >= 5 for kind in TYPES if kind not in ("LayoutIs", "Nonsense")), seen
