"""Hostile peers on the same machine (issue #37): raw ZeroMQ and TCP sockets to a reader's host and port, and
nothing else. Each test is one attack that stopped, steered or poisoned an engine before the control plane was
authenticated by default and in sessions, and each is judged only by what the engine serves (its version and its
bytes) and by whether the next honest version lands bit-exactly afterwards.

The "outsider" peers know the reader's host and port (a port scan finds them) but were not handed its address with
its key; the "insider" ones hold the key (a buggy or malicious process of the run itself) and still cannot stop the
reader's thread, nor make it allocate what they claim.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from rlsync import SyncOptions, WeightsReader, WeightsWriter
from rlsync.layouts import from_state_dict

STATE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.float32)}
LAYOUT = from_state_dict(STATE)
ENVELOPE = struct.Struct("!QQ")


def base(address: str) -> str:
    """The reader's host and port, which anyone on the machine can find, without the key its address carries."""
    return address.split("#")[0]


def key_of(reader: WeightsReader) -> bytes:
    """The key a reader's address carries: what an insider (a process handed the address) holds."""
    return reader.address.partition("#")[2].encode()


def raw_peer(address: str) -> Any:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(base(address))
    return sock


def signed(key: bytes, payload: bytes, session: int = 0, counter: int = 0) -> list[bytes]:
    """Frames as an rlsync peer holding ``key`` sends them (an insider)."""
    envelope = ENVELOPE.pack(session, counter)
    return [envelope, payload, hmac.new(key, envelope + payload, hashlib.sha256).digest()]


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
        peer = raw_peer(reader.address)
        key = key_of(reader)
        peer.send_multipart(signed(key, frame) if who == "insider" else [frame, b""])
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
        peer = raw_peer(reader.address)
        key = key_of(reader)
        peer.send_multipart(signed(key, msgspec.msgpack.encode({"type": "AskLayout", "src": msgspec.to_builtins(lying)})))
        assert peer.poll(10_000)
        answer = msgspec.msgpack.decode(peer.recv_multipart()[1])
        assert answer["type"] == "Refuse" and "GiB of landing memory" in answer["reason"], answer
        assert reader._thread.is_alive() and reader.dst is None  # type: ignore[attr-defined]
        honest_version(reader, 1, 2.0)
        peer.close()


def test_a_done_from_outside_the_session_changes_nothing() -> None:
    """Outsiders, and an insider outside a session or in another peer's, cannot finish a version: the engine
    keeps serving what it served (not the slot's stale bytes, not a version out of reach) and the next lands."""
    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        honest_version(reader, 1, 1.0)
        honest_version(reader, 2, 2.0)  # the other slot holds version 1: a forged Done would serve it as "new"
        peer = raw_peer(reader.address)
        key = key_of(reader)
        done = msgspec.msgpack.encode({"type": "Done", "writer_rank": 0, "version": 2**63 - 1, "slot": 1})  # the target
        peer.send_multipart([done, b""])  # outsider
        peer.send_multipart(signed(key, done))  # insider, no session
        peer.send_multipart(signed(key, done, session=12345, counter=1))  # insider, a session it was never given
        settle(reader, 3)
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
        peer = raw_peer(reader.address)
        hello = {"type": "Hello", "writer_rank": 0, "src_fingerprint": other.fingerprint(), "dst_fingerprint": "",
                 "dst_tensors": {}, "session": "s", "src": msgspec.to_builtins(other), "nonce": b"n" * 16}
        peer.send_multipart([msgspec.msgpack.encode(hello), b""])
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
    """With a shared secret (addresses typed by hand), a Hello and a Done recorded on the wire replay into a restarted
    engine on the same port: it must not go live on them (with direct landing that was all-zero weights)."""
    options = SyncOptions(secret="shared", timeout=20)
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
        peer = raw_peer(restarted.address)
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
    options = SyncOptions(secret="shared")
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
