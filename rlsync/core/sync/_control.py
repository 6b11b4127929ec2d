"""The control plane: small typed messages over ZeroMQ, encoded with msgspec (never pickle), every one signed.

Readers bind a ROUTER socket, writers connect DEALER sockets. **No reader accepts an unauthenticated peer**, loopback
included: every message carries an HMAC-SHA256 under a key only the run's processes hold. The key is the reader's
own, random per reader and carried in its address (``tcp://127.0.0.1:PORT#KEY``, a capability, like a notebook
server's token URL: whoever was handed the address may talk to it, and nobody else), or a shared ``secret``
(``secret=`` or ``RLSYNC_SECRET``, at least 128 bits: ``check_secret``) where addresses are typed by hand across
hosts. Binding a non-loopback address without either is refused. Keys never print: errors and log lines show
``#<key>`` (``rlsync.core._errors.redact``).

**Strangers are dropped at the handshake.** Every control socket speaks ZeroMQ's CURVE: the reader's key pair and
the writers' derive from the key (labels "curve reader", "curve writer"), so only a holder of the key can compute the
reader's public key, and a peer without it fails the handshake before it sends a byte that rlsync reads (ZeroMQ
counts it, ``Channel.failed_handshakes``; a writer whose key differs hears so at once). A connection that has not
finished the handshake within ``HANDSHAKE_MS`` is dropped. CURVE also encrypts the control plane and binds it to
each connection: a recording replays into nothing.

**Separate keys per use.** The long-term key signs nothing itself: the CURVE key pairs, the control plane's HMACs
(label "control"), the data plane's connect challenge (the tcp landing: "data plane"), and the sessions' keys (from
the control key and both sides' nonces) are each derived from it.

**Sessions, opened by a challenge.** Before anything else a writer ``Knock``s with a fresh nonce; the reader answers
``Challenge`` (a session id, its own fresh nonce, and whether it needs the writer's layout), signed under a key bound
to the writer's nonce. Every later message of both sides, the ``Hello`` and the ``AskLayout`` included, goes in that
session: signed with the session key (derived from both nonces) and numbered (frame ``envelope``: session id,
counter). A ``Hello`` or ``AskLayout`` counts only as the first message of a session that a ``Knock`` just opened, so
nothing a reader adopts was recorded earlier (a restarted reader's nonces are new), and a ``Welcome`` or ``LayoutIs``
comes in the writer's own fresh session. A message of an unknown session, of another peer's session, or whose
counter does not exceed the last one is refused.

**What a key holder's bad message costs.** A frame outside a session (``Knock`` is the only such message a reader
takes) longer than ``PRE_SESSION_BYTES`` is refused unread; a frame naming a session is refused unhashed unless the
session exists and is its sender's; frames are hashed and decoded where ZeroMQ received them (no copy). A reader
answers a frame it cannot authenticate with an unsigned ``Refuse`` (nothing signed under its key), at most
``UNAUTHENTICATED_ANSWERS`` per second. Every socket refuses a message longer than its bound (``max_control_bytes``;
a reader sizes it from its layout, ``bound_for``): ZeroMQ allocates a frame's length from its header before a byte of
it arrives, so without the bound a peer that merely claims 2 GiB would be given them while it trickles bytes. ZeroMQ
drops such a peer at the header; the others go on. Whatever else a frame holds (bytes that do not decode, invalid
UTF-8, deep nesting, a bad signature), it is a ``BadFrame`` for that frame alone.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import secrets
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Union

import msgspec
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from rlsync.core.sync._canary import Canary
from rlsync.core._errors import ConfigError, TransferTimeoutError, TransportError, redact
from rlsync.core.layouts import Layout
from rlsync.core.sync._peer_connections import PeerConnections
from rlsync.core.sync._stranger_budget import StrangerBudget

_log = logging.getLogger("rlsync")

#: seconds a writer waits in silence for its reader's first answer; then it says what it waits for (and keeps waiting)
SILENT_WAIT_S = 5.0


class Knock(msgspec.Struct, tag=True):
    """Writer -> reader, first and outside any session: a fresh nonce. Answered with ``Challenge``. ``rank``: the
    writer rank whose own credential signs it (``rank_address``); its session speaks for that rank alone."""

    nonce: bytes
    rank: int | None = None


class Challenge(msgspec.Struct, tag=True):
    """Reader -> writer: the session this ``Knock`` opened (signed under a key bound to the writer's nonce), the
    reader's own fresh nonce, whether it still needs the writers' layout (``Hello.src``, ``AskLayout.src``), and the
    longest message it accepts."""

    session: int
    nonce: bytes
    needs_src: bool = True
    max_bytes: int = 1 << 30


class Hello(msgspec.Struct, tag=True):
    """Writer -> reader, as the first message of a session a ``Knock`` opened: who I am and which plan I will run.

    ``session`` is new for every writer object: a rank whose session changes restarted, so whatever
    its earlier session did for an unfinished version is void. ``src`` is the writer's layout, for a
    reader that was not given one (it adopts the first it sees; later writers must match it)."""

    writer_rank: int
    src_fingerprint: str
    dst_fingerprint: str
    dst_tensors: dict[str, str]
    session: str = ""
    src: Layout | None = None
    #: the writer may send deltas (``rlsync.core.sync._delta``): the reader gives it an inbox
    delta: bool = False
    #: the writer sends checksums with every version (``SyncOptions(verify=True)``)
    checksums: bool = False


class AskLayout(msgspec.Struct, tag=True):
    """Writer -> reader, as the first message of a session a ``Knock`` opened: which destination layout do you
    receive into? ``src``: the writers' layout, from which a replica reader (one holding a whole copy) derives its
    own."""

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
    #: the checksum a verifying writer computes (``rlsync.core.sync._checksum``: where the reader's landing memory is)
    checksum: str = "crc32"
    #: the landing is the engine's own tensors, one region per buffer of this rank (in layout order): the writer
    #: asks with ``Begin`` before each version (the engine pauses) and writes ``(src, buffer index, offset, n)``
    in_place: bool = False
    #: what this session's data-plane connections prove (``Landing.admit``): a two-sided landing then takes their
    #: writes only in this writer rank's own part of the slot being written
    data_token: bytes = b""


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
    #: with checksums: ``rlsync.core.sync._checksum.digest`` of this writer's checksums as the reader checked them
    digest: str | None = None


Message = Union[Knock, Challenge, Hello, AskLayout, LayoutIs, Welcome, Refuse, Done, Ack, Begin, Go]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


MIN_SECRET_BITS = 128
_CLASSES = ((str.islower, 26), (str.isupper, 26), (str.isdigit, 10))


def secret_bits(secret: str) -> float:
    """An upper estimate of a secret's entropy: its length times the bits of the character classes it uses (a
    random 22-character letters-and-digits string has about 131)."""
    alphabet = sum(n for has, n in _CLASSES if any(has(c) for c in secret)) + (33 if any(not c.isalnum() for c in secret) else 0)
    return 0.0 if len(set(secret)) < 8 else len(secret) * math.log2(max(alphabet, 2))


def check_secret(secret: str, what: str = "the shared secret") -> None:
    """Refuse a secret weaker than ``MIN_SECRET_BITS``: anyone who can talk to a reader sees messages signed under
    keys derived from it, and a short one falls to an offline guess (a six-letter one in about a hundred)."""
    if secret_bits(secret) < MIN_SECRET_BITS:
        raise ConfigError(f"{what} is too weak to sign weights with (about {secret_bits(secret):.0f} bits of the "
                          f"{MIN_SECRET_BITS} required: a random string of 22 or more letters and digits): make one with "
                          f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'` and give every process the same")


def resolve_secret(host: str, secret: str | None) -> bytes | None:
    """The shared secret for ``host``: required off loopback, optional on it (where a reader makes its own key);
    refused when weaker than ``MIN_SECRET_BITS``."""
    from_env = secret is None and bool(os.environ.get("RLSYNC_SECRET"))
    secret = secret if secret is not None else os.environ.get("RLSYNC_SECRET") or None
    if secret is None and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on non-loopback address {host!r} without a shared secret: "
            f"pass secret=... or set RLSYNC_SECRET on every process (or bind 127.0.0.1)"
        )
    if secret:
        check_secret(secret, "RLSYNC_SECRET" if from_env else "SyncOptions(secret=...)")
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


# a rank credential in an address: #w.<rank>.<rank key, hex>.<the reader's CURVE public key, hex> (a reader's own key
# is URL-safe base64 or hex: never a ".")
_RANK = "w."


def rank_key(key: bytes, rank: int) -> bytes:
    """Writer rank ``rank``'s own key, derived from the reader's (or the shared secret): another rank cannot compute
    it from its own, and the reader can compute every rank's."""
    return derive(key, b"writer rank %d" % rank).hex().encode()


def rank_address(address: str, rank: int, secret: str | None = None) -> str:
    """The address writer rank ``rank`` is handed instead of ``address``: it carries that rank's own key (and the
    reader's public CURVE key, which it cannot derive), so its holder can speak for that rank alone. ``address``
    carries the reader's key, or ``secret`` (else ``RLSYNC_SECRET``) is the run's shared secret. An adapter that hands
    the trainer's ranks their readers' addresses hands each rank its own."""
    base, key = split_address(address)
    if key is not None and key.startswith(_RANK):
        raise ConfigError("rank_address: this address already carries one rank's credential; give the reader's own")
    master = key.encode() if key is not None else resolve_secret(host_port(base)[0], secret)
    if master is None:
        raise ConfigError(f"rank_address: {redact(address)} carries no key and no shared secret is set")
    public = zmq.curve_public(curve_keys(master)[0])
    return f"{base}#{_RANK}{rank}.{rank_key(master, rank).decode()}.{z85.decode(public).hex()}"


def rank_credential(key: str | None) -> tuple[int, bytes, bytes] | None:
    """``(rank, rank key, reader's CURVE public key)`` of an address key made by ``rank_address``; None for a
    reader's own key (or none)."""
    if key is None or not key.startswith(_RANK):
        return None
    rank, own, public = key[len(_RANK):].split(".") if key.count(".") == 3 else ("", "", "")
    if not rank.isdigit() or len(own) != 64 or len(public) != 64:
        raise ConfigError("the address carries a malformed rank credential: give it as rank_address made it")
    return int(rank), own.encode(), z85.encode(bytes.fromhex(public))


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


MIN_CONTROL_BYTES = 16 << 10  # ZeroMQ's CURVE handshake commands count too: a few hundred bytes each


def max_control_bytes() -> int:
    """The longest control message a socket accepts unless its layout says less (``bound_for``). The largest real
    ones carry a layout (every tensor's shards on every rank) or a checksum per tensor."""
    return max(MIN_CONTROL_BYTES, int(os.environ.get("RLSYNC_MAX_CONTROL_BYTES", 1 << 30)))


MIN_BOUND = 64 << 20
_LAYOUT_FACTOR = 64  # the writers' layout (in a Hello) against the engine's: 64 writer ranks per engine rank's shard


def bound_for(layout: Layout | None) -> int:
    """The longest control message a reader with ``layout`` accepts: 64 times the layout's encoded size (what an
    honest writer sends, its own layout and a checksum per tensor, scales with it), at least ``MIN_BOUND``, at most
    ``max_control_bytes()``; ``RLSYNC_MAX_CONTROL_BYTES`` set, or no layout yet (a replica reader): that."""
    if layout is None or "RLSYNC_MAX_CONTROL_BYTES" in os.environ:
        return max_control_bytes()
    return min(max_control_bytes(), max(MIN_BOUND, _LAYOUT_FACTOR * len(_encoder.encode(layout))))


PRE_SESSION_BYTES = 4096  # a Knock, a Challenge or an unsigned Refuse: anything longer outside a session is no peer's
HANDSHAKE_MS = 5000  # a connection that has not finished ZeroMQ's greeting by then is dropped (ZeroMQ's default: 30 s)
RECEIVE_QUEUE = 8  # messages ZeroMQ reads ahead per connection (its default, 1000, times the bound, per peer)
UNAUTHENTICATED_ANSWERS = 20  # unsigned refusals a reader sends per second, to all strangers together; the rest unanswered


_KEYS_DIFFER = ("the peers' keys differ (give the writer the reader's address as the reader gives it, with its #KEY, "
                "or the same SyncOptions(secret=...) or RLSYNC_SECRET on every process)")


class BadFrame(TransportError):
    """A control message that is not one: unsigned or signed with another key, of an unknown or another peer's
    session, replayed, or not decodable. ``identity``: the sender, where a router can answer it; ``authenticated``:
    whether it was signed by a holder of the key (an insider's frame) or not (anyone's)."""

    def __init__(self, message: str, identity: bytes | None, authenticated: bool = False) -> None:
        super().__init__(message)
        self.identity = identity
        self.authenticated = authenticated


_ENVELOPE = struct.Struct("!QQ")  # session id (0: before a session: a Knock or its Challenge), counter
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
    #: the writer rank whose own credential opened it (``rank_address``); None: the reader's key, good for any rank
    rank: int | None = None


def derive(key: bytes, label: bytes) -> bytes:
    """A key for one use (``label``) derived from ``key``: what signs one thing cannot be made to sign another."""
    return hmac.new(key, b"rlsync " + label, hashlib.sha256).digest()


def session_key(control_key: bytes, session: int, writer_nonce: bytes, reader_nonce: bytes) -> bytes:
    return derive(control_key, b"session" + _ENVELOPE.pack(session, 0) + writer_nonce + reader_nonce)


def challenge_key(control_key: bytes, writer_nonce: bytes) -> bytes:
    """What a reader signs its ``Challenge`` with: bound to the writer's fresh nonce (an old one does not replay)."""
    return derive(control_key, b"challenge" + writer_nonce)


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


def new_session_id() -> int:
    return secrets.randbits(63) + 1


class Channel:
    """One ZeroMQ socket speaking signed ``Message``s in sessions (``key``: the reader's key or the shared secret,
    from which the control and data-plane keys derive). A writer's channel opens its session with ``knock``; a
    reader's answers each ``Knock`` with ``answer_knock``."""

    def __init__(self, socket: zmq.Socket[bytes], key: bytes, monitor: zmq.Socket[bytes] | None = None, *,
                 rank: int | None = None, address: str | None = None) -> None:
        self.socket = socket
        self.address = address  # a writer's: where its reader is
        self.reached = False  # a writer's: a connection to its reader was made (else: refused, retrying)
        self._monitor = monitor  # the socket's handshake events (a reader's: failed ones; a writer's: until its Knock)
        self._key = key
        #: a writer's: the rank whose own credential it holds (its Knock says so), None with the reader's key
        self.rank = rank
        self.control_key = derive(key, b"control")
        self._rank_keys: OrderedDict[int, bytes] = OrderedDict()  # a reader's: writer ranks' control keys, derived
        #: a reader's: the connections that have not spoken yet, bounded (set by ``bind_router``)
        self.strangers: StrangerBudget | None = None
        #: a reader's: the connection each peer in a session spoke on, to name the peers whose connection closed
        self.peers: PeerConnections | None = None
        #: what the data plane's connect challenge proves (hex: transports take it as their "secret")
        self.data_key = derive(key, b"data plane").hex()
        self.sessions: OrderedDict[int, Session] = OrderedDict()
        self._of_peer: dict[bytes | None, int] = {}  # peer -> its newest session: what is sent to it is signed there
        self._knock: bytes | None = None  # a writer's nonce while its Knock waits for the Challenge
        self.limit = max_control_bytes()  # the longest message the peer takes (a writer learns its reader's)
        self._answers = float(UNAUTHENTICATED_ANSWERS)  # unsigned answers' token bucket (UNAUTHENTICATED_ANSWERS a second)
        self._answered_at = time.monotonic()

    def open_session(self, session: Session) -> None:
        """Sign what goes to ``session.peer`` under ``session`` from now on, and accept messages of it."""
        self.sessions[session.id] = session
        self._of_peer[session.peer] = session.id
        while len(self.sessions) > MAX_SESSIONS:
            _, old = self.sessions.popitem(last=False)
            if self._of_peer.get(old.peer) == old.id:
                del self._of_peer[old.peer]

    def _mac(self, key: bytes, envelope: bytes, payload: bytes | memoryview) -> bytes:
        signature = hmac.new(key, envelope, hashlib.sha256)
        signature.update(payload)
        return signature.digest()

    def _encode(self, message: Message) -> bytes:
        payload = _encoder.encode(message)
        if len(payload) > self.limit:  # the peer would drop us at the header without a word
            raise ConfigError(f"a {type(message).__name__} control message of {len(payload)} bytes is longer than the "
                              f"{self.limit} the reader accepts (sized from its layout): set RLSYNC_MAX_CONTROL_BYTES "
                              f"above it on every process")
        return payload

    def send(self, message: Message, identity: bytes | None = None) -> None:
        """``message`` in the peer's session; a ``Knock`` signed with the control key; to a peer without a session
        (a reader's answer to a stranger), unsigned and rate-limited (``send_unsigned``)."""
        payload = self._encode(message)
        session = self.sessions.get(self._of_peer.get(identity, 0))
        if isinstance(message, Knock):  # outside a session; the counter names the rank whose own key signs it
            envelope, key = _ENVELOPE.pack(0, 0 if self.rank is None else self.rank + 1), self.control_key
        elif session is None:
            self.send_unsigned(message, identity)
            return
        else:
            session.sent += 1
            envelope, key = _ENVELOPE.pack(session.id, session.sent), session.key
        frames = [envelope, payload, self._mac(key, envelope, payload)]
        self.socket.send_multipart(([identity] if identity is not None else []) + frames)

    def send_unsigned(self, message: Message, identity: bytes | None) -> bool:
        """``message`` with no signature (nothing signed under the key for a stranger to guess the key from), at most
        ``UNAUTHENTICATED_ANSWERS`` a second; whether it went."""
        now = time.monotonic()
        self._answers = min(UNAUTHENTICATED_ANSWERS, self._answers + (now - self._answered_at) * UNAUTHENTICATED_ANSWERS)
        self._answered_at = now
        if self._answers < 1:
            return False
        self._answers -= 1
        payload = _encoder.encode(message)[:PRE_SESSION_BYTES]
        self.socket.send_multipart(([identity] if identity is not None else []) + [_ENVELOPE.pack(0, 0), payload, b""])
        return True

    def answer_knock(self, identity: bytes, knock: Knock, needs_src: bool, max_bytes: int, rank: int | None = None) -> Session:
        """A reader's answer to a writer's ``Knock``: a new session, its id and the reader's nonce in a ``Challenge``
        signed under a key bound to the writer's nonce (and, for a rank's own credential, to that rank's key)."""
        nonce = new_nonce()
        control = self.control_key if rank is None else self.rank_control_key(rank)
        session = Session(new_session_id(), b"", peer=identity, rank=rank)
        session.key = session_key(control, session.id, knock.nonce, nonce)
        envelope, payload = _ENVELOPE.pack(0, 0), _encoder.encode(Challenge(session.id, nonce, needs_src, max_bytes))
        self.socket.send_multipart([identity, envelope, payload, self._mac(challenge_key(control, knock.nonce), envelope, payload)])
        self.open_session(session)
        return session

    def rank_control_key(self, rank: int) -> bytes:
        """A reader's: the control key of writer rank ``rank``'s own credential (``rank_address``), derived once."""
        found = self._rank_keys.get(rank)
        if found is None:
            found = self._rank_keys[rank] = derive(rank_key(self._key, rank), b"control")
            while len(self._rank_keys) > MAX_SESSIONS:
                self._rank_keys.popitem(last=False)
        return found

    def failed_handshakes(self) -> int:
        """How many peers failed ZeroMQ's CURVE handshake since the last call (peers without the key). A reader's
        channel also keeps its strangers' connections within their budget here (``_stranger_budget``) and notes the
        closed connections of its peers (``lost_peers``)."""
        failed = 0
        while self._monitor is not None and self._monitor.poll(0):
            got = recv_monitor_message(self._monitor)
            event, fd = got["event"], int(got["value"])
            failed += event & _FAILED != 0
            if self.strangers is not None:
                if event & zmq.EVENT_ACCEPTED:
                    self.strangers.accepted(fd)
                elif event & (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED):
                    self.strangers.closed(fd)
            if self.peers is not None and event & (zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED):
                self.peers.closed(fd)
        if self.strangers is not None:
            self.strangers.enforce()
        return failed

    def lost_peers(self) -> list[bytes]:
        """A reader's: the peers (identities) that spoke in a session and whose connection closed since the last call
        (as of the last ``failed_handshakes``)."""
        return [] if self.peers is None else self.peers.lost()

    def _handshake_failed(self) -> bool:
        """A writer's: whether its reader dropped it at the handshake (it took the writer's keys for another's)."""
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event & zmq.EVENT_CONNECTED:
                self.reached = True
            if event & (zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED):
                continue
            if event & zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._close_monitor()
                return False
            if event & (_FAILED | zmq.EVENT_DISCONNECTED):
                return True
        return False

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            self.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def knock(self, timeout_ms: int) -> Challenge | None:
        """A writer opens its session: ``Knock``, and the reader's ``Challenge`` (None: no answer within the
        timeout). Every message after it goes in the session. A reader that drops the writer at ZeroMQ's CURVE
        handshake (its key differs) is a ``TransportError`` at once, not a timeout."""
        self._knock = new_nonce()
        self.send(Knock(self._knock, self.rank))
        started = time.monotonic()
        deadline = started + timeout_ms / 1000
        said = False
        while not self.socket.poll(min(50, max(0, int((deadline - time.monotonic()) * 1000)))):
            if self._handshake_failed():
                raise TransportError("the reader dropped this writer at the handshake: " + _KEYS_DIFFER)
            now = time.monotonic()
            if now >= deadline:
                return None
            if not said and now - started >= SILENT_WAIT_S:  # a wait says what it waits for, long before it gives up
                said = True
                _log.warning("rlsync: no answer for %.0f s (still waiting up to %.0f s more): %s", now - started,
                             deadline - now, self.waiting_for())
        self._close_monitor()
        got = self.recv(0)
        if got is None:
            return None
        challenge = got[1]
        assert isinstance(challenge, Challenge)  # recv takes nothing else outside a session on a writer's side
        self.open_session(Session(challenge.session, session_key(self.control_key, challenge.session, self._knock, challenge.nonce)))
        self._knock = None
        self.limit = min(self.limit, challenge.max_bytes)
        return challenge

    def waiting_for(self) -> str:
        """What a writer's wait for its reader's answer is, so far: nothing listening there, or a reader that is slow."""
        where = redact(self.address or "its reader")
        if self.reached:
            return f"the reader at {where} accepted the connection but has not answered"
        return f"nothing listens at {where} (connection refused, retried): is the engine up, and is this its address?"

    def recv(self, timeout_ms: int | None = None) -> tuple[bytes | None, Message, Session | None] | None:
        """``(identity or None, message, its session or None)``, or None when nothing arrived within the timeout."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        parts = self.socket.recv_multipart(copy=False)  # lengths are checked before a byte is copied
        router = self.socket.type == zmq.ROUTER
        fd = int(parts[0].get(zmq.SRCFD)) if router and parts else -1  # the connection it came on (a reader's)
        if self.strangers is not None and parts:  # it passed the CURVE handshake: the key's holder's connection
            self.strangers.proven(fd)
        identity = parts[0].bytes if router and parts else None
        if len(parts) != (4 if router else 3) or len(parts[-3]) != _ENVELOPE.size or len(parts[-1]) > 64:
            raise BadFrame(f"a control message of {len(parts)} frames (not an rlsync peer?)", identity)
        envelope, mac = parts[-3].bytes, parts[-1].bytes
        session_id, counter = _ENVELOPE.unpack(envelope)
        if not session_id and len(parts[-2]) > PRE_SESSION_BYTES:  # refused unread: outside a session only a Knock comes
            raise BadFrame(f"a control message of {len(parts[-2])} bytes outside a session", identity)
        payload = parts[-2].buffer  # hashed and decoded where ZeroMQ received it
        session = None
        if session_id:
            session = self.sessions.get(session_id)
            if session is None or session.peer != identity:
                raise BadFrame("a control message of an unknown session, or of another peer's (replayed from an earlier "
                               "run, or forged)", identity)
            key = session.key
        elif router:  # a Knock: signed with the reader's key, or (counter = rank + 1) with that writer rank's own
            key = self.control_key if not counter else self.rank_control_key(counter - 1)
        elif self._knock is not None and mac:
            key = challenge_key(self.control_key, self._knock)
        else:
            raise BadFrame("the reader could not authenticate this writer's messages: " + _KEYS_DIFFER, identity)
        if not hmac.compare_digest(mac, self._mac(key, envelope, payload)):
            raise BadFrame("a control message with a bad signature: " + _KEYS_DIFFER, identity)
        if session is not None:
            if counter <= session.received:
                raise BadFrame(f"a control message replayed or out of order in its session (counter {counter} after "
                               f"{session.received})", identity, authenticated=True)
            session.received = counter
            if self.peers is not None and identity is not None:
                self.peers.spoke(fd, identity)
        try:
            message = _decoder.decode(payload)
        except Exception as exc:  # noqa: BLE001 - msgspec raises more than DecodeError (invalid UTF-8, deep nesting)
            raise BadFrame(f"a malformed control message ({type(exc).__name__}: {exc})", identity, authenticated=True) from exc
        if session is None and not isinstance(message, Knock if router else Challenge):
            raise BadFrame(f"a {type(message).__name__} outside a session (a writer Knocks first)", identity, authenticated=True)
        if isinstance(message, Knock) and message.rank != (counter - 1 if counter else None):
            raise BadFrame("a Knock whose rank is not the one its signature is for", identity, authenticated=True)
        if session is not None and isinstance(message, (Knock, Challenge)):
            raise BadFrame(f"a {type(message).__name__} inside a session", identity, authenticated=True)
        return identity, message, session

    def close(self) -> None:
        self._close_monitor()
        self.socket.close(linger=0)


_FAILED = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


def curve_keys(key: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """The reader's CURVE key pair and the writers', derived from ``key`` (z85: secret, public, secret, public). Only a
    holder of the key can compute the reader's public key, and ZeroMQ's CURVE handshake needs it: a peer without it is
    dropped at the handshake, before it sends a byte rlsync reads."""
    server, client = z85.encode(derive(key, b"curve reader")), z85.encode(derive(key, b"curve writer"))
    return server, zmq.curve_public(server), client, zmq.curve_public(client)


def _socket(kind: int, max_bytes: int, key: bytes, server_public: bytes | None = None) -> zmq.Socket[bytes]:
    """``server_public``: the reader's public key where ``key`` is one rank's (which cannot derive it)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(kind)
    server_secret, server_public_of_key, client_secret, client_public = curve_keys(key)
    if kind == zmq.ROUTER:
        sock.curve_secretkey = server_secret
        sock.curve_server = True
    else:
        sock.curve_serverkey = server_public or server_public_of_key
        sock.curve_publickey = client_public
        sock.curve_secretkey = client_secret
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # set before bind: a listener keeps the options it was bound with
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    sock.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
    return sock


def _monitor(sock: zmq.Socket[bytes], events: int) -> zmq.Socket[bytes]:
    """``sock``'s event monitor, unbounded: ZeroMQ's I/O thread sends monitor events blocking, so a monitor queue that
    filled up (its HWM, 1000 by default, reached between two reads of a busy reader) would stall every socket of the
    process's context."""
    endpoint = f"inproc://rlsync-monitor-{secrets.token_hex(8)}"
    sock.monitor(endpoint, events)
    monitor: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PAIR)
    monitor.setsockopt(zmq.RCVHWM, 0)
    monitor.setsockopt(zmq.LINGER, 0)
    monitor.connect(endpoint)
    return monitor


def bind_router(host: str = "127.0.0.1", port: int = 0, secret: str | None = None,
                max_bytes: int | None = None) -> tuple[Channel, str]:
    """A ROUTER channel for a reader, and the address writers connect to: with a secret (``secret`` or
    ``RLSYNC_SECRET``) the plain ``tcp://host:port``; without one, the reader makes its own key and the address
    carries it (``tcp://host:port#KEY``). ``max_bytes``: the longest message it accepts (``bound_for``)."""
    shared = resolve_secret(host, secret)
    key = new_key()
    sock = _socket(zmq.ROUTER, max_bytes or max_control_bytes(), shared or key.encode())
    monitor = _monitor(sock, _FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
    if port:
        _bind(sock, f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    address = f"tcp://{host}:{port}"
    channel = Channel(sock, shared or key.encode(), monitor)
    channel.strangers = StrangerBudget()  # strangers hold an eighth of the descriptors at most
    channel.peers = PeerConnections()
    return (channel, address) if shared else (channel, f"{address}#{key}")


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
    own = rank_credential(key)
    if key is not None and own is None:
        check_secret(key, "the key of the reader address")
    secret_key: bytes = (own[1] if own else key.encode()) if key is not None else shared  # type: ignore[assignment]
    sock = _socket(zmq.DEALER, max_control_bytes(), secret_key, server_public=own[2] if own else None)
    monitor = sock.get_monitor_socket(_FAILED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                                      | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
    sock.connect(base)
    return Channel(sock, secret_key, monitor, rank=own[0] if own else None, address=base)


def open_channel(address: str, secret: str | None, timeout: float) -> tuple[Channel, Challenge]:
    """A writer's channel to the reader at ``address``, its session opened (``Knock``, ``Challenge``): what it sends
    next is the first message of a fresh session (a ``Hello`` or an ``AskLayout``)."""
    channel = connect_dealer(address, secret)
    try:
        challenge = channel.knock(int(timeout * 1000))
    except BaseException:
        channel.close()
        raise
    if challenge is None:
        waited = channel.waiting_for()
        channel.close()
        raise TransferTimeoutError(f"the reader at {address} did not answer within {timeout} s: {waited}")
    return channel, challenge
