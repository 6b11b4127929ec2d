"""A raw ZeroMQ peer that speaks rlsync's control protocol by hand, written from its documentation
(``rlsync/core/sync/_control.py``), not from its code: what an attacker who read the docs sends. An *insider* holds the
reader's key (a buggy or malicious process of the run, or one the key leaked to): it derives the control key, Knocks,
checks the reader's Challenge and signs in the session it opens. An *outsider* knows only the host and port.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import msgspec
import zmq
from zmq.utils import z85

ENVELOPE = struct.Struct("!QQ")  # session id (0: outside a session), counter


def derive(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, b"rlsync " + label, hashlib.sha256).digest()


def mac(key: bytes, envelope: bytes, payload: bytes) -> bytes:
    return hmac.new(key, envelope + payload, hashlib.sha256).digest()


def base(address: str) -> str:
    """The reader's host and port, which anyone on the machine can find, without the key its address carries."""
    return address.split("#")[0]


def key_in(address: str) -> bytes:
    return address.partition("#")[2].encode()


def raw_peer(address: str) -> Any:
    """A plain ZeroMQ peer (no CURVE keys: a stranger). Its sends give up after a second: a reader never completes
    its handshake, so nothing it sends is delivered."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    sock.connect(base(address))
    return sock


def stranger_sends(address: str, *messages: list[bytes]) -> Any:
    """A stranger's peer that sends ``messages`` (each a list of frames) as far as ZeroMQ lets it; the socket."""
    sock = raw_peer(address)
    for frames in messages:
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            break
    return sock


def curve_peer(address: str, key: bytes) -> Any:
    """A DEALER that passes the reader's CURVE handshake: its keys derived from ``key`` as the docs say."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    server = z85.encode(derive(key, b"curve reader"))
    client = z85.encode(derive(key, b"curve writer"))
    sock.curve_serverkey = zmq.curve_public(server)
    sock.curve_publickey = zmq.curve_public(client)
    sock.curve_secretkey = client
    sock.connect(base(address))
    return sock


class Insider:
    """A peer holding ``key`` (default: the one ``address`` carries), on its own connection (or ``sock``)."""

    def __init__(self, address: str, key: bytes | None = None, sock: Any = None) -> None:
        key = key if key is not None else key_in(address)
        self.sock = sock if sock is not None else curve_peer(address, key)
        self.control = derive(key, b"control")
        self.session = 0
        self.session_key = b""
        self.counter = 0

    def pre_session(self, payload: bytes) -> list[bytes]:
        """``payload`` outside any session, signed with the control key (as a Knock is)."""
        envelope = ENVELOPE.pack(0, 0)
        return [envelope, payload, mac(self.control, envelope, payload)]

    def knock(self, timeout_ms: int = 10_000) -> dict[str, Any]:
        """Open a session: Knock with a fresh nonce, check the Challenge's signature, derive the session key."""
        import secrets

        nonce = secrets.token_bytes(16)
        self.sock.send_multipart(self.pre_session(msgspec.msgpack.encode({"type": "Knock", "nonce": nonce})))
        expected = derive(self.control, b"challenge" + nonce)
        while True:  # answers to earlier messages (unsigned, in a session, Challenges to other Knocks) are skipped
            if not self.sock.poll(timeout_ms):
                raise TimeoutError("the reader did not answer the Knock")
            envelope, payload, signature = self.sock.recv_multipart()
            if ENVELOPE.unpack(envelope)[0] == 0 and hmac.compare_digest(signature, mac(expected, envelope, payload)):
                break
        challenge = msgspec.msgpack.decode(payload)
        assert challenge["type"] == "Challenge", challenge
        self.session, self.counter = challenge["session"], 0
        self.session_key = derive(self.control, b"session" + ENVELOPE.pack(self.session, 0) + nonce + challenge["nonce"])
        return dict(challenge)

    def in_session(self, payload: bytes, counter: int | None = None) -> list[bytes]:
        """``payload`` in this peer's session, numbered next (or ``counter``)."""
        self.counter = self.counter + 1 if counter is None else counter
        envelope = ENVELOPE.pack(self.session, self.counter)
        return [envelope, payload, mac(self.session_key, envelope, payload)]

    def send(self, message: dict[str, Any]) -> None:
        self.sock.send_multipart(self.in_session(msgspec.msgpack.encode(message)))

    def answer(self, timeout_ms: int = 10_000, of_session: bool = True) -> dict[str, Any] | None:
        """The next answer in this peer's session (others skipped), decoded; None when none came in time."""
        while self.sock.poll(timeout_ms):
            envelope, payload, _ = self.sock.recv_multipart()
            if not of_session or ENVELOPE.unpack(envelope)[0] == self.session:
                return dict(msgspec.msgpack.decode(payload))
        return None

    def close(self) -> None:
        self.sock.close()
