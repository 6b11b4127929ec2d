"""``tcp``: a portable fallback. The reader runs a thread that receives each run straight into
its region (``recv_into``, no intermediate copy); the writer streams runs with a small fixed
header. Loopback by default; another address requires the shared secret, proven by an
HMAC challenge before any byte is accepted."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from rlsync import Landing, Link, PeerLostError, Run, Transport, resolve_secret

_HEADER = struct.Struct("!IQQ")  # slot, offset, nbytes; nbytes == 0 asks for a flush acknowledgement
_FLUSH_SLOT = 0xFFFFFFFF


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    while view:
        got = conn.recv_into(view)
        if not got:
            raise ConnectionError("peer closed the connection")
        view = view[got:]


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
        self._thread = threading.Thread(target=self._serve, name="rlsync-tcp-landing", daemon=True)
        self._thread.start()

    @property
    def regions(self) -> Sequence[np.ndarray]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return {"host": self._address[0], "port": self._address[1]}

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        header = bytearray(_HEADER.size)
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                if self._secret:
                    nonce = secrets.token_bytes(16)
                    conn.sendall(nonce)
                    proof = bytearray(32)
                    _recv_exact(conn, memoryview(proof))
                    if not hmac.compare_digest(bytes(proof), hmac.new(self._secret, nonce, hashlib.sha256).digest()):
                        return
                while True:
                    _recv_exact(conn, memoryview(header))
                    slot, offset, nbytes = _HEADER.unpack(header)
                    if slot == _FLUSH_SLOT:
                        conn.sendall(b"\x01")
                        continue
                    if slot >= self.slots or offset + nbytes > self.nbytes:
                        return  # out of bounds: drop the connection, the writer sees it fail
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
        if secret:
            nonce = bytearray(16)
            _recv_exact(self._sock, memoryview(nonce))
            self._sock.sendall(hmac.new(secret, bytes(nonce), hashlib.sha256).digest())

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


