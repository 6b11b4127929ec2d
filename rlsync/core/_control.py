"""The control plane: small typed messages over ZeroMQ, encoded with msgspec (never pickle).

Readers bind a ROUTER socket, writers connect DEALER sockets. Addresses default to loopback;
binding anything else requires a shared secret (``secret=`` or ``RLSYNC_SECRET``), and then
every message carries an HMAC-SHA256 of its payload that the other side checks.

Every socket refuses a message longer than ``max_control_bytes()`` (1 GiB, ``RLSYNC_MAX_CONTROL_BYTES`` to change):
ZeroMQ allocates a frame's length from its header before a byte of it arrives, so without the bound a peer that
merely claims 2 GiB would be given them while it trickles bytes. ZeroMQ drops such a peer at the header; the others
go on.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from typing import Any, Union

import msgspec
import zmq

from rlsync.core._canary import Canary
from rlsync.core._errors import ConfigError, TransportError
from rlsync.core._layout import Layout


class Hello(msgspec.Struct, tag=True):
    """Writer -> reader: who I am and which plan I will run.

    ``session`` is new for every writer object: a rank whose session changes restarted, so whatever
    its earlier session did for an unfinished version is void. ``src`` is the writer's layout, for a
    reader that was not given one (it adopts the first it sees; later writers must match it)."""

    writer_rank: int
    src_fingerprint: str
    dst_fingerprint: str
    dst_tensors: dict[str, str]
    session: str = ""
    src: Layout | None = None
    #: the writer may send deltas (``rlsync.core._delta``): the reader gives it an inbox
    delta: bool = False
    #: the writer sends checksums with every version (``SyncOptions(verify=True)``)
    checksums: bool = False


class AskLayout(msgspec.Struct, tag=True):
    """Writer -> reader: which destination layout do you receive into? ``src``: the writers' layout, from
    which a replica reader (one holding a whole copy) derives its own."""

    src: Layout | None = None


class LayoutIs(msgspec.Struct, tag=True):
    """Reader -> writer: the destination layout (every engine rank's buffers and shards), and the live version."""

    layout: Layout
    live_version: int = -1


class Welcome(msgspec.Struct, tag=True):
    """Reader -> writer: where to write, and the newest live version."""

    reader_rank: int
    transport: str
    description: dict[str, Any]
    live_version: int
    next_slot: int
    #: for a delta writer: the inbox landing's description, and this writer's part of it
    inbox: dict[str, Any] | None = None
    inbox_offset: int = 0
    inbox_capacity: int = 0
    #: the checksum a verifying writer computes (``rlsync.core._checksum``: where the reader's landing memory is)
    checksum: str = "crc32"
    #: the landing is the engine's own tensors, one region per buffer of this rank (in layout order): the writer
    #: asks with ``Begin`` before each version (the engine pauses) and writes ``(src, buffer index, offset, n)``
    in_place: bool = False


class Refuse(msgspec.Struct, tag=True):
    """Reader -> writer: the handshake or a version was refused; ``reason`` says why and what to do."""

    reason: str
    kind: str = "mismatch"  # "mismatch", "version", "load" or "restart"


class Done(msgspec.Struct, tag=True):
    """Writer -> reader: all my bytes of ``version`` landed in ``slot``."""

    writer_rank: int
    version: int
    slot: int
    checksums: dict[str, int] | None = None
    #: a delta against version ``delta_base`` (what the slot held), ``delta_nbytes`` long in the inbox
    delta_base: int | None = None
    delta_nbytes: int = 0
    #: the trainer's canary for this version (``rlsync.Canary``), checked by the engine before it serves
    canary: Canary | None = None


class Begin(msgspec.Struct, tag=True):
    """Writer -> in-place reader: about to write ``version``; answered with ``Go`` once the engine has paused."""

    writer_rank: int
    version: int


class Go(msgspec.Struct, tag=True):
    """In-place reader -> writer: the engine is paused (and its last version saved); write."""

    version: int


class Ack(msgspec.Struct, tag=True):
    """Reader -> writer: ``version`` is live; write the next one into ``next_slot``."""

    version: int
    next_slot: int
    #: the engine's canary deviation for this version (mean nats per token), when it checked one
    canary_deviation: float | None = None
    #: with checksums: ``rlsync.core._checksum.digest`` of this writer's checksums as the reader checked them
    digest: str | None = None


Message = Union[Hello, AskLayout, LayoutIs, Welcome, Refuse, Done, Ack, Begin, Go]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def resolve_secret(host: str, secret: str | None) -> bytes | None:
    """The shared secret for ``host``: required off loopback, optional on it."""
    secret = secret if secret is not None else os.environ.get("RLSYNC_SECRET") or None
    if secret is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on non-loopback address {host!r} without a shared secret: "
            f"pass secret=... or set RLSYNC_SECRET on every process (or bind 127.0.0.1)"
        )
    return secret.encode() if secret else None


def max_control_bytes() -> int:
    """The longest control message a socket accepts. The largest real ones carry a layout (every tensor's shards on
    every rank) or a checksum per tensor."""
    return int(os.environ.get("RLSYNC_MAX_CONTROL_BYTES", 1 << 30))


class BadFrame(TransportError):
    """A control message that is not one: unsigned or signed with another secret, or not decodable. ``identity``:
    the sender, where a router can answer it."""

    def __init__(self, message: str, identity: bytes | None) -> None:
        super().__init__(message)
        self.identity = identity


class Channel:
    """One ZeroMQ socket speaking ``Message``s, with optional HMAC signing."""

    def __init__(self, socket: zmq.Socket[bytes], secret: bytes | None) -> None:
        self.socket = socket
        self.secret = secret

    def _mac(self, payload: bytes) -> bytes:
        return hmac.new(self.secret, payload, hashlib.sha256).digest() if self.secret else b""

    def send(self, message: Message, identity: bytes | None = None) -> None:
        payload = _encoder.encode(message)
        if len(payload) > max_control_bytes():  # the peer would drop us at the header without a word
            raise ConfigError(f"a {type(message).__name__} control message of {len(payload)} bytes is longer than "
                              f"RLSYNC_MAX_CONTROL_BYTES={max_control_bytes()}: raise it on every process")
        frames = [payload, self._mac(payload)]
        self.socket.send_multipart(([identity] if identity is not None else []) + frames)

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes | None, Message] | None:
        """``(identity or None, message)``, or None when nothing arrived within the timeout."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart()
        identity = frames[0] if len(frames) == 3 and self.socket.type == zmq.ROUTER else None
        if len(frames) != (3 if self.socket.type == zmq.ROUTER else 2):
            raise BadFrame(f"a control message of {len(frames)} frames (not an rlsync peer?)", frames[0] if frames else None)
        payload, mac = frames[-2], frames[-1]
        if self.secret and not hmac.compare_digest(mac, self._mac(payload)):
            raise BadFrame("a control message with a bad signature: the peers' secrets differ (give every process the "
                           "same SyncOptions(secret=...) or RLSYNC_SECRET)", identity)
        try:
            return identity, _decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise BadFrame(f"a malformed control message ({exc})", identity) from exc

    def close(self) -> None:
        self.socket.close(linger=0)


def _socket(kind: int) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_control_bytes())
    return sock


def bind_router(host: str = "127.0.0.1", port: int = 0, secret: str | None = None) -> tuple[Channel, str]:
    """A ROUTER channel for a reader, and the address writers connect to."""
    key = resolve_secret(host, secret)
    sock = _socket(zmq.ROUTER)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return Channel(sock, key), f"tcp://{host}:{port}"


def connect_dealer(address: str, secret: str | None = None) -> Channel:
    host = address.rsplit(":", 1)[0].removeprefix("tcp://")
    key = resolve_secret(host, secret)
    sock = _socket(zmq.DEALER)
    sock.connect(address)
    return Channel(sock, key)
