"""The control plane: small typed messages over ZeroMQ, encoded with msgspec (never pickle), every one signed.

Readers bind a ROUTER socket, writers connect DEALER sockets. **No reader accepts an unauthenticated peer**, loopback
included: every message carries an HMAC-SHA256 under a key only the run's processes hold. The key is the reader's
own, random per reader and carried in its address (``tcp://127.0.0.1:PORT#KEY``, a capability, like a notebook
server's token URL: whoever was handed the address may talk to it, and nobody else), or a shared ``secret``
(``secret=`` or ``RLSYNC_SECRET``) where addresses are typed by hand across hosts. Binding a non-loopback address
without either is refused.

**Sessions.** A writer's ``Hello`` carries a fresh nonce; the reader answers ``Welcome`` with a session id and a
nonce of its own, and from then on both sides sign with a key derived from the two nonces and number every message
(frame ``envelope``: session id, counter). A message of an unknown session, of another peer's session, or whose
counter does not exceed the last one is refused: messages recorded in an earlier run, or earlier in this one, do not
replay, and one peer cannot speak in another's session.

Every socket refuses a message longer than ``max_control_bytes()`` (1 GiB, ``RLSYNC_MAX_CONTROL_BYTES`` to change):
ZeroMQ allocates a frame's length from its header before a byte of it arrives, so without the bound a peer that
merely claims 2 GiB would be given them while it trickles bytes. ZeroMQ drops such a peer at the header; the others
go on. Whatever else a frame holds (bytes that do not decode, invalid UTF-8, deep nesting, a bad signature), it
is a ``BadFrame`` for that frame alone.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import secrets
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
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
    #: fresh per Hello: the session key derives from it and the reader's nonce (``Welcome``)
    nonce: bytes = b""


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
    #: the session this Welcome opens (every later message of both sides is signed under it), and the reader's nonce
    session: int = 0
    nonce: bytes = b""


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
    """Writer -> reader: about to write ``version`` (or, from a node relay, about to tell it of ``version``); answered
    with ``Go`` (an in-place reader: once the engine has paused)."""

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
    """The shared secret for ``host``: required off loopback, optional on it (where a reader makes its own key)."""
    secret = secret if secret is not None else os.environ.get("RLSYNC_SECRET") or None
    if secret is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on non-loopback address {host!r} without a shared secret: "
            f"pass secret=... or set RLSYNC_SECRET on every process (or bind 127.0.0.1)"
        )
    return secret.encode() if secret else None


def new_key() -> str:
    """A random key for a reader's address (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def split_address(address: str) -> tuple[str, str | None]:
    """``"tcp://host:port#KEY"`` as ``("tcp://host:port", "KEY")``; the key is None when the address has none."""
    base, _, key = address.partition("#")
    return base, key or None


def with_key(address: str, key: str | None = None) -> str:
    """``address`` carrying ``key`` (a fresh one by default): what an adapter hands an engine whose reader it
    addresses, so that only the trainer it also hands the address to can talk to that reader."""
    return f"{split_address(address)[0]}#{key or new_key()}"


def keyed(address: str, secret: str | None = None) -> str:
    """What an adapter hands both sides when it picks a reader's address itself: ``address`` with a fresh key, unless
    a shared secret is configured (``secret`` or ``RLSYNC_SECRET``: then the address travels without one)."""
    host, _ = host_port(address)
    return address if resolve_secret(host, secret) else with_key(address)


def shift_port(address: str, by: int) -> str:
    """``address`` with its port ``by`` higher and its key kept: the address of engine rank ``by`` when rank r
    listens on PORT + r (the vLLM and SGLang adapters)."""
    base, key = split_address(address)
    host, port = host_port(base)
    return f"tcp://{host}:{port + by}" + (f"#{key}" if key else "")


def host_port(address: str) -> tuple[str, int]:
    """The host and port of ``tcp://host:port[#KEY]``."""
    host, _, port = split_address(address)[0].removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{address!r} is not a reader address: expected tcp://HOST:PORT (as WeightsReader.address gives it)")
    return host, int(port)


def max_control_bytes() -> int:
    """The longest control message a socket accepts. The largest real ones carry a layout (every tensor's shards on
    every rank) or a checksum per tensor."""
    return int(os.environ.get("RLSYNC_MAX_CONTROL_BYTES", 1 << 30))


class BadFrame(TransportError):
    """A control message that is not one: unsigned or signed with another key, of an unknown or another peer's
    session, replayed, or not decodable. ``identity``: the sender, where a router can answer it."""

    def __init__(self, message: str, identity: bytes | None) -> None:
        super().__init__(message)
        self.identity = identity


_ENVELOPE = struct.Struct("!QQ")  # session id (0: before a session, signed with the key itself), counter
MAX_SESSIONS = 4096  # sessions a reader keeps (the oldest go first): far more than writers of one engine


@dataclass
class Session:
    """A writer-reader session: its id, its key, the last counter received from the peer and sent to it, and the
    peer it is with (a router's identity of the writer; None on the writer's side)."""

    id: int
    key: bytes
    peer: bytes | None = None
    received: int = 0
    sent: int = 0


def session_key(key: bytes, session: int, writer_nonce: bytes, reader_nonce: bytes) -> bytes:
    return hmac.new(key, b"rlsync session" + _ENVELOPE.pack(session, 0) + writer_nonce + reader_nonce, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def new_session_id() -> int:
    return secrets.randbits(63) + 1


class Channel:
    """One ZeroMQ socket speaking signed ``Message``s (``key``: the reader's key or the shared secret), in sessions
    once they are opened (``open_session``)."""

    def __init__(self, socket: zmq.Socket[bytes], key: bytes) -> None:
        self.socket = socket
        self.key = key
        self.sessions: OrderedDict[int, Session] = OrderedDict()
        self._of_peer: dict[bytes | None, int] = {}  # peer -> its newest session: what is sent to it is signed there

    def open_session(self, session: Session) -> None:
        """Sign what goes to ``session.peer`` under ``session`` from now on, and accept messages of it."""
        self.sessions[session.id] = session
        self._of_peer[session.peer] = session.id
        while len(self.sessions) > MAX_SESSIONS:
            _, old = self.sessions.popitem(last=False)
            if self._of_peer.get(old.peer) == old.id:
                del self._of_peer[old.peer]

    def _mac(self, key: bytes, envelope: bytes, payload: bytes) -> bytes:
        return hmac.new(key, envelope + payload, hashlib.sha256).digest()

    def send(self, message: Message, identity: bytes | None = None) -> None:
        payload = _encoder.encode(message)
        if len(payload) > max_control_bytes():  # the peer would drop us at the header without a word
            raise ConfigError(f"a {type(message).__name__} control message of {len(payload)} bytes is longer than "
                              f"RLSYNC_MAX_CONTROL_BYTES={max_control_bytes()}: raise it on every process")
        session = self.sessions.get(self._of_peer.get(identity, 0))
        if session is None or isinstance(message, (Hello, Welcome)):  # a session opens with these: signed with the key
            envelope, key = _ENVELOPE.pack(0, 0), self.key
        else:
            session.sent += 1
            envelope, key = _ENVELOPE.pack(session.id, session.sent), session.key
        frames = [envelope, payload, self._mac(key, envelope, payload)]
        self.socket.send_multipart(([identity] if identity is not None else []) + frames)

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes | None, Message, Session | None] | None:
        """``(identity or None, message, its session or None)``, or None when nothing arrived within the timeout."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        frames = self.socket.recv_multipart()
        router = self.socket.type == zmq.ROUTER
        identity = frames[0] if router and frames else None
        if len(frames) != (4 if router else 3) or len(frames[-3]) != _ENVELOPE.size:
            raise BadFrame(f"a control message of {len(frames)} frames (not an rlsync peer?)", identity)
        envelope, payload, mac = frames[-3], frames[-2], frames[-1]
        session_id, counter = _ENVELOPE.unpack(envelope)
        session = None
        if session_id:
            session = self.sessions.get(session_id)
            if session is None or session.peer != identity:
                raise BadFrame("a control message of an unknown session, or of another peer's (replayed from an earlier "
                               "run, or forged)", identity)
        key = self.key if session is None else session.key
        if not hmac.compare_digest(mac, self._mac(key, envelope, payload)):
            raise BadFrame("a control message with a bad signature: the peers' keys differ (give the writer the "
                           "reader's address as the reader gives it, with its #KEY, or the same SyncOptions(secret=...) "
                           "or RLSYNC_SECRET on every process)", identity)
        if session is not None:
            if counter <= session.received:
                raise BadFrame(f"a control message replayed or out of order in its session (counter {counter} after "
                               f"{session.received})", identity)
            session.received = counter
        try:
            message = _decoder.decode(payload)
        except Exception as exc:  # noqa: BLE001 - msgspec raises more than DecodeError (invalid UTF-8, deep nesting)
            raise BadFrame(f"a malformed control message ({type(exc).__name__}: {exc})", identity) from exc
        return identity, message, session

    def close(self) -> None:
        self.socket.close(linger=0)


def _socket(kind: int) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_control_bytes())
    return sock


def bind_router(host: str = "127.0.0.1", port: int = 0, secret: str | None = None) -> tuple[Channel, str]:
    """A ROUTER channel for a reader, and the address writers connect to: with a secret (``secret`` or
    ``RLSYNC_SECRET``) the plain ``tcp://host:port``; without one, the reader makes its own key and the address
    carries it (``tcp://host:port#KEY``)."""
    shared = resolve_secret(host, secret)
    key = new_key()
    sock = _socket(zmq.ROUTER)
    if port:
        _bind(sock, f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    address = f"tcp://{host}:{port}"
    return (Channel(sock, shared), address) if shared else (Channel(sock, key.encode()), f"{address}#{key}")


def _bind(sock: zmq.Socket[bytes], endpoint: str, wait: float = 2.0) -> None:
    """Bind ``endpoint``, waiting up to ``wait`` seconds while it is in use: a reader this process closed a moment ago
    on the same port (a receiver restarted in place) has its listener released by ZMQ's I/O thread, asynchronously."""
    deadline = time.monotonic() + wait
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def connect_dealer(address: str, secret: str | None = None) -> Channel:
    """A DEALER channel to the reader at ``address``, signed with the key the address carries, else the secret."""
    base, key = split_address(address)
    host, _ = host_port(base)
    shared = resolve_secret(host, secret)
    if key is None and shared is None:
        raise ConfigError(f"the reader address {address!r} carries no key and no secret was given: pass the address "
                          f"exactly as the reader gives it (WeightsReader.address, with its #KEY), or give every "
                          f"process the same SyncOptions(secret=...) or RLSYNC_SECRET")
    sock = _socket(zmq.DEALER)
    sock.connect(base)
    return Channel(sock, key.encode() if key is not None else shared)  # type: ignore[arg-type]
