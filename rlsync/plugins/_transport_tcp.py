"""``tcp``: a portable fallback. The reader runs a thread that receives each run straight into
its region (``recv_into``, no intermediate copy); the writer streams runs with a small fixed
header. Loopback by default; another address requires the shared secret. Every connection answers a challenge
before any byte is accepted: with the token its reader's session gave the writer (``options["token"]``), which binds
the connection to what that writer may write (``Landing.admit``: its own part of the slot being written), or, on a
landing that admitted no token (the transport used without a reader), the data-plane key (``options["secret"]``).

What a stranger costs: one thread accepts and challenges every connection; one that has not answered within
``CHALLENGE_SECONDS`` is dropped, and past ``MAX_UNPROVEN`` waiting (or an eighth of the process's file descriptors)
the oldest is (an honest writer answers within a round trip); the accept loop outlives running out of file descriptors (it waits and goes on). A flood of idle
connections costs a descriptor each for a few seconds, and cannot end the landing."""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import resource
import secrets
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from rlsync import Landing, Link, PeerLostError, Run, Transport, resolve_secret

_HEADER = struct.Struct("!IQQ")  # slot, offset, nbytes; nbytes == 0 asks for a flush acknowledgement
_FLUSH_SLOT = 0xFFFFFFFF
_LABEL = b"rlsync tcp landing"  # what the proof signs besides the nonce: the key proves nothing else with it
CHALLENGE_SECONDS = 5.0
MAX_UNPROVEN = 256
_OUT_OF = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # accept fails, the listener is fine
_log = logging.getLogger("rlsync")


def proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, _LABEL + nonce, hashlib.sha256).digest()


def token_id(token: bytes) -> bytes:
    """What a connection names its token by (the token itself never crosses)."""
    return hashlib.sha256(b"rlsync tcp token " + token).digest()[:16]


_NO_TOKEN = bytes(16)
_ANSWER = 16 + 32  # the token's id (zeros: none), then the proof
Writable = Callable[[int, int, int], bool]


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while view:
        got = conn.recv_into(view)
        if not got:
            raise ConnectionError("peer closed the connection")
        view = view[got:]


def _anywhere(slot: int, offset: int, nbytes: int) -> bool:
    return True


class TcpLanding(Landing):
    name: ClassVar[str] = "tcp"
    one_sided: ClassVar[bool] = False  # a thread of the reader process receives the bytes

    def __init__(self, nbytes: int, slots: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(nbytes, slots, options)
        self._regions = [np.zeros(max(nbytes, 1), dtype=np.uint8) for _ in range(slots)]
        host = str(self.options.get("host", "127.0.0.1"))
        self._secret = resolve_secret(host, self.options.get("secret"))
        self._server = socket.create_server((host, int(self.options.get("port", 0))))
        self._address = (host, self._server.getsockname()[1])
        self._closed = False
        self._tokens: dict[bytes, tuple[bytes, Writable]] = {}  # token id -> (token, what its writer may write)
        self._tokens_only = False  # set by the first admit: a reader's landing takes token holders alone
        #: writes refused because they fell outside what their connection's writer may write (connection dropped)
        self.refused_writes = 0
        #: connections dropped unanswered because ``MAX_UNPROVEN`` newer ones were waiting, and accepts that failed
        #: for want of file descriptors or memory (the landing went on)
        self.turned_away = 0
        self.accept_failures = 0
        # strangers' connections may hold an eighth of the process's descriptors at most: the engine needs the rest
        self._max_unproven = min(MAX_UNPROVEN, max(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8))
        self._thread = threading.Thread(target=self._serve, name="rlsync-tcp-landing", daemon=True)
        self._thread.start()

    @property
    def regions(self) -> Sequence[np.ndarray]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return {"host": self._address[0], "port": self._address[1]}

    def admit(self, token: bytes, writable: Writable) -> None:
        self._tokens[token_id(token)] = (token, writable)
        self._tokens_only = True

    def revoke(self, token: bytes) -> None:
        self._tokens.pop(token_id(token), None)

    def _serve(self) -> None:
        """Accept connections and challenge them, all in this one thread (a stranger's idle connection costs a
        descriptor and a table entry, not a thread); a connection that proves the key gets a thread of its own."""
        unproven: dict[socket.socket, tuple[bytes, float, bytearray]] = {}  # oldest first
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            while not self._closed:
                try:
                    ready = selector.select(timeout=0.5)
                except (OSError, ValueError):  # the listener was closed
                    break
                for key, _ in ready:
                    if key.fileobj is self._server:
                        self._accept(selector, unproven)
                    else:
                        self._answered(selector, unproven, key.fileobj)  # type: ignore[arg-type]
                now = time.monotonic()
                for conn in [c for c, (_, deadline, _) in unproven.items() if deadline < now]:
                    self._drop(selector, unproven, conn)
            for conn in list(unproven):
                self._drop(selector, unproven, conn)

    def _accept(self, selector: selectors.BaseSelector, unproven: dict[socket.socket, tuple[bytes, float, bytearray]]) -> None:
        try:
            conn, _ = self._server.accept()
        except OSError as exc:
            if exc.errno in _OUT_OF:  # out of descriptors: the connections that hold them time out; wait
                self.accept_failures += 1
                if self.accept_failures == 1:
                    _log.warning("tcp landing on port %d: accept failed (%s); it waits for connections to close",
                                 self._address[1], exc)
                time.sleep(0.05)
            return
        if not self._secret and not self._tokens_only:
            threading.Thread(target=self._receive, args=(conn, _anywhere), daemon=True).start()
            return
        if len(unproven) >= self._max_unproven:  # the oldest goes: an honest writer answers within a round trip
            self.turned_away += 1
            self._drop(selector, unproven, next(iter(unproven)))
        nonce = secrets.token_bytes(16)
        try:
            conn.setblocking(False)
            conn.send(nonce)  # 16 bytes into an empty send buffer
        except OSError:
            conn.close()
            return
        unproven[conn] = (nonce, time.monotonic() + CHALLENGE_SECONDS, bytearray())
        selector.register(conn, selectors.EVENT_READ)

    def _answered(self, selector: selectors.BaseSelector, unproven: dict[socket.socket, tuple[bytes, float, bytearray]],
                  conn: socket.socket) -> None:
        nonce, _, answer = unproven[conn]
        try:
            got = conn.recv(_ANSWER - len(answer))
        except BlockingIOError:
            return
        except OSError:
            got = b""
        answer += got
        if got and len(answer) < _ANSWER:
            return
        selector.unregister(conn)
        del unproven[conn]
        writable = self._proven(bytes(answer), nonce) if got else None
        if writable is None:
            conn.close()
            return
        conn.setblocking(True)
        threading.Thread(target=self._receive, args=(conn, writable), daemon=True).start()

    def _proven(self, answer: bytes, nonce: bytes) -> Writable | None:
        """What the connection that answered ``answer`` may write (None: it proved nothing)."""
        named, signed = answer[:16], answer[16:]
        if named == _NO_TOKEN:
            if self._tokens_only or not hmac.compare_digest(signed, proof(self._secret, nonce)):  # type: ignore[arg-type]
                return None
            return _anywhere
        found = self._tokens.get(named)
        if found is None or not hmac.compare_digest(signed, proof(found[0], nonce)):
            return None
        return found[1]

    @staticmethod
    def _drop(selector: selectors.BaseSelector, unproven: dict[socket.socket, tuple[bytes, float, bytearray]],
              conn: socket.socket) -> None:
        unproven.pop(conn, None)
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _receive(self, conn: socket.socket, writable: Writable) -> None:
        header = bytearray(_HEADER.size)
        with conn:
            try:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    _recv_exact(conn, memoryview(header))
                    slot, offset, nbytes = _HEADER.unpack(header)
                    if slot == _FLUSH_SLOT:
                        conn.sendall(b"\x01")
                        continue
                    if slot >= self.slots or offset + nbytes > self.nbytes:
                        return  # out of bounds: drop the connection, the writer sees it fail
                    if not writable(slot, offset, nbytes):  # another rank's part, or the live slot: dropped unread
                        self.refused_writes += 1
                        _log.warning("tcp landing on port %d: a writer wrote %d bytes at %d of slot %d, outside its own "
                                     "part of the slot being written: connection dropped", self._address[1], nbytes,
                                     offset, slot)
                        return
                    _recv_exact(conn, memoryview(self._regions[slot])[offset : offset + nbytes])
            except (ConnectionError, OSError):
                return

    def close(self) -> None:
        self._closed = True
        self._server.close()


class TcpLink(Link):
    def __init__(self, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> None:
        host, port = description["host"], int(description["port"])
        # the writer's timeout: a partitioned network fails a send or a flush within it, not after a fixed wait
        timeout = float((options or {}).get("timeout") or 30.0)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerLostError(f"cannot reach the reader's tcp landing at {host}:{port}: {exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        secret = resolve_secret(host, (options or {}).get("secret"))
        token = (options or {}).get("token") or None
        if secret or token:
            nonce = bytearray(16)
            try:
                _recv_exact(self._sock, memoryview(nonce))
                if token:  # the reader's session gave this writer a token: it names it and proves it
                    self._sock.sendall(token_id(token) + proof(token, bytes(nonce)))
                else:
                    self._sock.sendall(_NO_TOKEN + proof(secret, bytes(nonce)))  # type: ignore[arg-type]
            except OSError as exc:
                raise PeerLostError(f"the reader's tcp landing at {host}:{port} closed the connection at its challenge: {exc}") from exc

    def write(self, source: np.ndarray, runs: Sequence[Run]) -> None:
        view = source.data  # a memoryview of the bytes
        try:
            for s, slot, d, n in runs:
                self._sock.sendall(_HEADER.pack(slot, d, n))
                self._sock.sendall(view[s : s + n])
        except OSError as exc:
            raise PeerLostError(f"the reader's tcp landing dropped the connection: {exc}") from exc

    def flush(self) -> None:
        try:
            self._sock.sendall(_HEADER.pack(_FLUSH_SLOT, 0, 0))
            if self._sock.recv(1) != b"\x01":
                raise PeerLostError("the reader's tcp landing closed the connection before acknowledging")
        except OSError as exc:
            raise PeerLostError(f"the reader's tcp landing dropped the connection: {exc}") from exc

    def close(self) -> None:
        self._sock.close()


class TcpTransport(Transport):
    name: ClassVar[str] = "tcp"
    landing: ClassVar[type[Landing]] = TcpLanding
    compress_deltas: ClassVar[bool] = True  # across hosts, often 1-25 Gbit/s: zstd pays below ~6 Gbit/s (benchmarks)

    @classmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        return TcpLink(description, options)


