"""Hostile peers on the same machine (issues #37 and #54): raw ZeroMQ and TCP sockets to a reader's host and port, and
nothing else. Each test is one attack that stopped, steered, stalled or poisoned an engine before its fix, and each is
judged only by what the engine serves (its version and its bytes), what it costs the engine, and whether the next
honest version lands bit-exactly afterwards.

The "outsider" peers know the reader's host and port (a port scan finds them) but were not handed its address with
its key; the "insider" ones hold the key (a buggy or malicious process of the run itself, ``_support.insider``) and
still cannot stop the reader's thread, nor make it allocate what they claim.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from _support.insider import ENVELOPE, Insider, curve_peer, stranger_sends
from rlsync import SyncOptions, WeightsReader, WeightsWriter
from rlsync.layouts import from_state_dict

STATE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.float32)}
LAYOUT = from_state_dict(STATE)
SECRET = "Zq3vN8rT1xW5yB7cK2mP9sL4hD6fG0jA"  # a shared secret of the required strength (about 190 bits by its classes)


def honest_version(reader: WeightsReader, version: int, scale: float, options: SyncOptions | None = None) -> None:
    """A real trainer lands ``version`` and the engine serves exactly its bytes."""
    state = {n: t * scale for n, t in STATE.items()}
    with WeightsWriter(LAYOUT, None, 0, [reader.address], options=options or SyncOptions(timeout=20)) as writer:
        writer.multi_put(state)
        writer.complete(version)
    assert reader.version == version
    for name, tensor in state.items():
        assert bytes(reader.buffers()[name]) == tensor.numpy().tobytes(), name


def serves(reader: WeightsReader, version: int, scale: float) -> None:
    assert reader.version == version
    for name, tensor in STATE.items():
        assert bytes(reader.buffers()[name]) == (tensor * scale).numpy().tobytes(), name


def settle(reader: WeightsReader, rejected: int, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while getattr(reader, "rejected", 0) < rejected and time.monotonic() < deadline:
        time.sleep(0.01)


NOT_UTF8 = b"\x81\xa4type\xa2\xff\xfe"  # {"type": <2 bytes that are not UTF-8>}: 10 bytes
DEEP = msgspec.msgpack.encode({"type": "AskLayout", "x": 1}).replace(b"\xa1x\x01", b"\xa1x" + b"\x91" * 20000 + b"\x01")


@pytest.mark.parametrize("frame", [NOT_UTF8, DEEP], ids=["invalid-utf8", "deep-nesting"])
@pytest.mark.parametrize("who", ["outsider", "insider"])
def test_no_frame_stops_the_reader_thread(frame: bytes, who: str) -> None:
    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        honest_version(reader, 1, 1.0)
        if who == "insider":
            peer = Insider(reader.address)
            peer.knock()
            peer.sock.send_multipart(peer.in_session(frame))
        else:  # dropped at the CURVE handshake: the frame never reaches the reader
            peer = stranger_sends(reader.address, [frame, b""])
        settle(reader, 1)
        assert reader._thread.is_alive()  # type: ignore[attr-defined]
        serves(reader, 1, 1.0)
        honest_version(reader, 2, 3.0)
        peer.close()


def test_a_peer_declared_layout_is_bounded_before_it_is_allocated() -> None:
    """A replica reader learns its layout from the writers: an insider's 1 TiB claim is refused before allocation."""
    from rlsync.core import Box, Shard, TensorMeta, make_layout

    with WeightsReader(None, None, 0, replicas=1) as reader:
        # 1 TiB, described in a few bytes
        lying = make_layout([TensorMeta("w", "float32", (2**38,))], [Shard("w", Box((0,), (2**38,)), 0, "w", 0, (1,))])
        peer = Insider(reader.address)
        assert peer.knock()["needs_src"]
        peer.send({"type": "AskLayout", "src": msgspec.to_builtins(lying)})
        answer = peer.answer()
        assert answer is not None and answer["type"] == "Refuse" and "GiB of landing memory" in answer["reason"], answer
        assert reader._thread.is_alive() and reader.dst is None  # type: ignore[attr-defined]
        honest_version(reader, 1, 2.0)
        peer.close()


def test_a_done_from_outside_the_session_changes_nothing() -> None:
    """Outsiders, and an insider outside a session or in another peer's, cannot finish a version: the engine
    keeps serving what it served (not the slot's stale bytes, not a version out of reach) and the next lands."""
    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        honest_version(reader, 1, 1.0)
        honest_version(reader, 2, 2.0)  # the other slot holds version 1: a forged Done would serve it as "new"
        peer = Insider(reader.address)
        done = msgspec.msgpack.encode({"type": "Done", "writer_rank": 0, "version": 2**63 - 1, "slot": 1})  # the target
        peer.sock.send_multipart([done, b""])  # outsider
        peer.sock.send_multipart(peer.pre_session(done))  # insider, no session
        peer.knock()
        peer.sock.send_multipart(peer.in_session(done))  # insider, in a session that said no Hello
        peer.session = 12345
        peer.sock.send_multipart(peer.in_session(done))  # insider, a session it was never given
        settle(reader, 4)
        serves(reader, 2, 2.0)
        honest_version(reader, 3, 5.0)
        peer.close()


def test_bytes_on_the_tcp_data_plane_from_outside_the_session_are_refused() -> None:
    """The tcp landing takes bytes only from a peer that proves the reader's key at connect."""
    options = SyncOptions(transport="tcp", timeout=20)
    with WeightsReader(LAYOUT, LAYOUT, 0, options=options) as reader:
        honest_version(reader, 1, 1.0, options)
        landing = reader._landing.describe()  # type: ignore[union-attr]  # its port: what a scan finds
        conn = socket.create_connection((landing["host"], landing["port"]), timeout=5)
        nan = np.full(8, np.nan, dtype=np.float32).tobytes()
        try:  # an in-bounds write into the live slot (slot 0 after one direct version is the served one)
            for slot in (0, 1):
                conn.sendall(struct.pack("!IQQ", slot, 0, len(nan)) + nan)
        except OSError:
            pass  # dropped: the challenge was not answered
        conn.close()
        time.sleep(0.2)
        serves(reader, 1, 1.0)
        honest_version(reader, 2, 4.0, options)


def test_a_stranger_cannot_fix_the_layout_before_the_trainer() -> None:
    """A replica reader adopts the first writer's layout: an outsider's Hello with another layout comes first and is
    refused unread; the real trainer's layout is the one the reader plans for."""
    with WeightsReader(None, None, 0, replicas=1) as reader:
        other = from_state_dict({"x": torch.zeros(4)})
        hello = {"type": "Hello", "writer_rank": 0, "src_fingerprint": other.fingerprint(), "dst_fingerprint": "",
                 "dst_tensors": {}, "session": "s", "src": msgspec.to_builtins(other)}
        peer = stranger_sends(reader.address, [msgspec.msgpack.encode(hello), b""])
        settle(reader, 1)
        assert reader.dst is None
        honest_version(reader, 1, 2.0)
        peer.close()


class Recorder:
    """What a writer's socket sends, frame for frame (as a host on the path would record it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[list[bytes]] = []
        original = zmq.Socket.send_multipart

        def send_multipart(sock: Any, frames: Any, *args: Any, **kwargs: Any) -> Any:
            if sock.type == zmq.DEALER:
                self.sent.append([bytes(f) for f in frames])
            return original(sock, frames, *args, **kwargs)

        monkeypatch.setattr(zmq.Socket, "send_multipart", send_multipart)


def test_messages_recorded_in_an_earlier_run_do_not_replay_into_a_restarted_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a shared secret (addresses typed by hand), a Hello and a Done recorded in an earlier run replay into a
    restarted engine on the same port: it must not go live on them (with direct landing that was all-zero weights).
    CURVE keeps a host on the path from reading or replaying a recording at all; a key holder replays the plaintext."""
    options = SyncOptions(secret=SECRET, timeout=20)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    recorder = Recorder(monkeypatch)
    with WeightsReader(LAYOUT, LAYOUT, 0, options=options.replace(port=port)) as reader:
        honest_version(reader, 10, 7.0, options)
    recorded = list(recorder.sent)
    monkeypatch.undo()
    assert any(b"Done" in frames[1] for frames in recorded if len(frames) == 3)
    with WeightsReader(LAYOUT, LAYOUT, 0, options=options.replace(port=port)) as restarted:
        peer = curve_peer(restarted.address, SECRET.encode())
        for frames in recorded:
            peer.send_multipart(frames)
            time.sleep(0.05)
        time.sleep(0.5)
        assert restarted.version == -1  # nothing went live on replayed messages
        honest_version(restarted, 2, 3.0, options)  # and the honest trainer is not locked out (2 < the replayed 10)
        peer.close()


def test_a_reader_restarted_in_place_binds_the_port_its_predecessor_just_closed() -> None:
    """ZMQ releases a closed listener asynchronously: without waiting for it, about one restart in five on the same
    port failed with "Address already in use" (seen in CI, in the test above)."""
    options = SyncOptions(secret=SECRET)
    for _ in range(30):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        WeightsReader(LAYOUT, LAYOUT, 0, options=options.replace(port=port)).close()
        WeightsReader(LAYOUT, LAYOUT, 0, options=options.replace(port=port)).close()


def test_an_address_keeps_its_key_when_shifted_to_another_rank() -> None:
    """Adapters address engine rank r at PORT + r: the key travels with every rank's address."""
    from rlsync.core import keyed, shift_port, split_address

    address = keyed("tcp://127.0.0.1:5000")
    assert split_address(shift_port(address, 2)) == ("tcp://127.0.0.1:5002", split_address(address)[1])
    assert shift_port("tcp://127.0.0.1:5000", 1) == "tcp://127.0.0.1:5001"  # with a shared secret: no key to keep


# -- round 2 (issue #54) ---------------------------------------------------------------------------------------------


def test_one_unsigned_frame_does_not_fail_an_engines_wait_for_its_next_version() -> None:
    """The trainer is connected and the engine waits for version 2 (as vLLM's update_weights does); a stranger sends
    one 10-byte frame. Before: it set ``refusal`` and the waiting engine failed with ConfigError, and so did the
    trainer's complete. Now it is counted and nothing else: the wait goes on and version 2 lands in it."""
    from rlsync import StagedReceiver

    tensors = [[name, "float32", list(t.shape)] for name, t in STATE.items()]
    with StagedReceiver(tensors, options=SyncOptions(timeout=20)) as receiver:
        writer = WeightsWriter(LAYOUT, None, 0, [receiver.address], options=SyncOptions(timeout=20))
        got: dict[str, Any] = {}

        def engine() -> None:
            try:
                version, views, finish = receiver.next(20)
                got["version"], got["views"] = version, {n: t.clone() for n, t in views}
                finish(None)
            except BaseException as exc:  # noqa: BLE001 - the test reads it
                got["error"] = exc

        import threading

        writer.multi_put(STATE)
        thread = threading.Thread(target=engine)
        thread.start()
        writer.complete(1)
        thread.join(20)
        thread = threading.Thread(target=engine)
        thread.start()  # the engine waits for version 2
        stranger = stranger_sends(receiver.address, [NOT_UTF8, b""])
        insider = Insider(receiver.address)  # and a key holder's frame that is no message: the same
        insider.sock.send_multipart([NOT_UTF8, b""])
        settle(receiver.reader, 2)
        time.sleep(0.3)  # the engine's wait looks at the reader's refusal every 50 ms
        assert receiver.reader.refusal is None and "error" not in got, got
        assert receiver.reader.rejected >= 2 and receiver.reader.last_rejection  # for a person to read
        writer.multi_put({n: t * 2 for n, t in STATE.items()})
        writer.complete(2)
        thread.join(20)
        assert "error" not in got and got["version"] == 2, got
        assert torch.equal(got["views"]["w"], STATE["w"] * 2)
        stranger.close()
        insider.close()
        writer.close()


def test_a_stranger_hears_nothing_and_an_unauthenticated_frame_is_answered_unsigned() -> None:
    """Nothing signed under a reader's key (or a weak secret) reaches anyone who could guess the key from it offline
    (a six-letter secret fell in 113 guesses): a stranger is dropped at the handshake and hears nothing; a frame that
    fails its HMAC is answered unsigned; a key holder is answered in its session."""
    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        ask = [ENVELOPE.pack(0, 0), msgspec.msgpack.encode({"type": "AskLayout"}), b"\x00" * 32]
        stranger = stranger_sends(reader.address, ask)
        assert not stranger.poll(1000)
        settle(reader, 1)
        assert reader.rejected >= 1 and "handshake" in str(reader.last_rejection)
        insider = Insider(reader.address)
        insider.sock.send_multipart(ask)
        assert insider.sock.poll(5000)
        envelope, payload, signature = insider.sock.recv_multipart()
        assert signature == b"" and msgspec.msgpack.decode(payload)["type"] == "Refuse"
        insider.knock()
        insider.send({"type": "AskLayout"})
        assert insider.answer()["type"] == "LayoutIs"  # type: ignore[index]
        stranger.close()
        insider.close()


def test_a_shared_secret_weaker_than_128_bits_is_refused_naming_how_to_make_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlsync import ConfigError

    for weak in ("s3cret", "shared", "correct horse", "a" * 64):
        with pytest.raises(ConfigError, match=r"too weak .*secrets\.token_urlsafe\(32\)"):
            WeightsReader(LAYOUT, LAYOUT, 0, options=SyncOptions(secret=weak))
    monkeypatch.setenv("RLSYNC_SECRET", "s3cret")
    with pytest.raises(ConfigError, match="RLSYNC_SECRET is too weak"):
        WeightsReader(LAYOUT, LAYOUT, 0)
    monkeypatch.setenv("RLSYNC_SECRET", SECRET)
    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        honest_version(reader, 1, 1.0)


def test_a_recorded_hello_and_ask_layout_replayed_into_a_restarted_reader_adopt_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recording of an earlier run (a shared secret, the same port) replayed into a restarted reader that learns
    its source layout (or all of its layout) from its first writer. Before: it adopted the recorded Hello's layout
    before it checked the nonce (a restarted reader has seen none), and the trainer of this run, whose layout
    differs, was locked out ("source layout differs")."""
    options = SyncOptions(secret=SECRET, timeout=20)
    earlier = from_state_dict({**STATE, "extra": torch.zeros(4)})  # the earlier run's trainer exported one more tensor
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for replicas in (None, 1):  # a reader that knows its layout but not the writers'; a replica that learns both
        recorder = Recorder(monkeypatch)
        with WeightsReader(None, None if replicas else LAYOUT, 0, replicas=replicas, options=options.replace(port=port)) as reader:
            with WeightsWriter(earlier, None, 0, [reader.address], options=options.replace(extra_tensors="ignore")) as writer:
                writer.multi_put({**STATE, "extra": torch.zeros(4)})
                writer.complete(1)
        recorded = list(recorder.sent)
        monkeypatch.undo()
        assert any(b"Hello" in frames[1] for frames in recorded) and any(b"AskLayout" in frames[1] for frames in recorded)
        with WeightsReader(None, None if replicas else LAYOUT, 0, replicas=replicas, options=options.replace(port=port)) as restarted:
            peer = curve_peer(restarted.address, SECRET.encode())  # a key holder's plaintext recording
            for frames in recorded:
                peer.send_multipart(frames)
            settle(restarted, sum(b"Knock" not in frames[1] for frames in recorded))  # a Knock is answered: harmless
            assert restarted.plan is None and (restarted.dst is None) == bool(replicas)  # nothing adopted
            honest_version(restarted, 1, 2.0, options)  # this run's trainer, with its own layout, lands
            peer.close()


def test_a_recorded_challenge_does_not_open_a_session_for_a_writer() -> None:
    """A reader's Challenge is bound to the writer's nonce (and the Welcome to the session it opens): a fake reader
    that answers every Knock with a Challenge recorded from the real one gets no writer to talk to it."""
    from rlsync import TransportError

    with WeightsReader(LAYOUT, LAYOUT, 0, options=SyncOptions(secret=SECRET)) as reader:
        insider = Insider(reader.address, key=SECRET.encode())
        insider.knock()
        recorded = None
        insider.sock.send_multipart(insider.pre_session(msgspec.msgpack.encode({"type": "Knock", "nonce": b"r" * 16})))
        assert insider.sock.poll(5000)
        recorded = insider.sock.recv_multipart()
        insider.close()
    from zmq.utils import z85

    from _support.insider import derive

    fake = zmq.Context.instance().socket(zmq.ROUTER)  # a key holder posing as the reader (it passes the handshake)
    fake.curve_secretkey = z85.encode(derive(SECRET.encode(), b"curve reader"))
    fake.curve_server = True
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    import threading

    def answer_with_the_recording() -> None:
        if fake.poll(10_000):
            identity = fake.recv_multipart()[0]
            fake.send_multipart([identity, *recorded])

    thread = threading.Thread(target=answer_with_the_recording)
    thread.start()
    with pytest.raises(TransportError, match="bad signature"):
        WeightsWriter(LAYOUT, None, 0, [f"tcp://127.0.0.1:{port}"], options=SyncOptions(secret=SECRET, timeout=5))
    thread.join()
    fake.close()


def test_keys_never_print_in_errors_or_logs(caplog: pytest.LogCaptureFixture) -> None:
    """The writer's errors named the whole address with its #KEY; logs that others can read handed the key on."""
    from rlsync import RlsyncError

    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        key = reader.address.partition("#")[2]
        other = from_state_dict({"x": torch.zeros(3)})
        with pytest.raises(RlsyncError) as refused:
            WeightsWriter(other, LAYOUT, 0, [reader.address], options=SyncOptions(timeout=5)).complete(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"tcp://127.0.0.1:{s.getsockname()[1]}#{key}"
    with pytest.raises(RlsyncError) as timed_out:
        WeightsWriter(LAYOUT, None, 0, [gone], options=SyncOptions(timeout=0.5))
    import logging

    logging.getLogger("rlsync").warning("connecting to %s", gone)
    for text in (str(refused.value), repr(refused.value), str(timed_out.value), caplog.text):
        assert key not in text, text
    assert "#<key>" in str(timed_out.value) and "#<key>" in caplog.text


def test_a_live_readers_shared_memory_is_kept_whatever_its_pid_says() -> None:
    """A container sharing /dev/shm (--ipc=host) sees another's readers under pids it cannot signal: before, the next
    reader took a live landing for dead and unlinked it. Now only files that no process holds a lock on go."""
    import glob
    import os

    from rlsync.plugins import remove_stale_regions

    options = SyncOptions(transport="shm", timeout=20)
    with WeightsReader(LAYOUT, LAYOUT, 0, options=options) as reader:
        honest_version(reader, 1, 1.0, options)
        live = sorted(glob.glob(f"/dev/shm/rlsync-{os.getpid()}-*"))[0]
        elsewhere = "/dev/shm/rlsync-4194303-feedbeef-0"  # the same landing, named as another PID namespace's reader
        os.link(live, elsewhere)
        other = "/dev/shm/rlsync-bench-hostile-test"  # not a landing's name (rlsync bench's folder): never touched
        os.makedirs(other, exist_ok=True)
        try:
            removed = remove_stale_regions()
            assert elsewhere not in removed and os.path.exists(elsewhere) and os.path.isdir(other)
            honest_version(reader, 2, 3.0, options)
        finally:
            os.rmdir(other)
    assert elsewhere in remove_stale_regions()  # its reader closed: nobody holds the lock now


def test_a_delta_of_many_small_segments_is_refused_before_any_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key holder's 22 KB delta of many segments, each claiming the whole region in a tiny zstd frame: before, each
    was decoded (1.77 GB added to the engine) before any was checked against the others."""
    from rlsync.core import apply_delta

    try:
        from compression import zstd  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        from backports import zstd  # type: ignore[no-redef, unused-ignore]
    region = torch.zeros(1 << 20, dtype=torch.uint8)
    segments, count = 50, region.numel()  # each claims a value for every byte of the region
    frame = zstd.compress(bytes(count * 5))  # 5 MiB of planes in a few hundred bytes
    headers = torch.tensor([[0, 1, count, 0, len(frame)]] * segments, dtype=torch.int64)  # base, itemsize, count, mode, nbytes
    padded = frame + bytes(-len(frame) % 8)
    payload = torch.frombuffer(bytearray(torch.tensor([segments], dtype=torch.int64).numpy().tobytes()
                                         + headers.numpy().tobytes() + padded * segments), dtype=torch.uint8)
    assert payload.numel() < 64 << 10
    decoded = []
    real = __import__("rlsync.core.sync._delta", fromlist=["_decompress"])._decompress
    monkeypatch.setattr("rlsync.core.sync._delta._decompress", lambda *a: decoded.append(1) or real(*a))
    with pytest.raises(ValueError, match="claims .* more than the .*-byte region"):
        apply_delta(payload, region)
    assert not decoded and not region.any()
