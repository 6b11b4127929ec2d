"""Which Redis entries rlsync trusts: those its own run signed. Anyone who can write to the run's Redis (a password
shared wider than the run, an ACL that lets another job write the same keys, an open port) could otherwise put a
sample at the head of the trainer's queue, an episode the engine never generated, or a tool result never produced.

Every entry rlsync writes (a sample's payload, an episode's prompt, each recorded step) carries an HMAC-SHA256 under a
key derived from the run's (``rlsync.core.user_key()``: ``RLSYNC_SECRET``, or this user's key file; processes on other
hosts need the same ``RLSYNC_SECRET``) and the buffer's name, bound to where the entry belongs (the sample's or the
episode's id, the step's index): an entry moved to another place no longer verifies. What fails is refused, never
decoded: counted (``foreign``), logged once per ``LOGGED_EVERY`` seconds, and removed from what honest entries wait
behind. A Redis writer can still delete entries (it owns the data): give the run's Redis a password or an ACL user of
its own, TLS across hosts (``rediss://``), and no port beyond the run's hosts (docs/reliability.md)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time

from rlsync.core import user_key

MAC_BYTES = 32
LOGGED_EVERY = 10.0
_log = logging.getLogger("rlsync")


class EntrySigner:
    """Signs and checks the entries of one buffer ``name`` (``key``: default ``user_key()``)."""

    def __init__(self, name: str, key: bytes | None = None) -> None:
        self._key = hmac.new(key if key is not None else user_key(), b"rlsync redis entries " + name.encode(),
                             hashlib.sha256).digest()
        self.name = name
        self.foreign = 0  # entries refused since this object was made
        self._logged_at = float("-inf")
        self._unlogged = 0

    def _mac(self, where: tuple[str, ...], payload: bytes) -> bytes:
        signature = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in where:  # length-prefixed: no two places encode alike
            raw = part.encode()
            signature.update(struct.pack("!I", len(raw)) + raw)
        signature.update(payload)
        return signature.digest()

    def sign(self, payload: bytes, *where: str) -> bytes:
        """``payload`` as stored: its signature for the place ``where`` (kind, id, ...), then the payload."""
        return self._mac(where, bytes(payload)) + bytes(payload)

    def open(self, entry: bytes | None, *where: str) -> bytes | None:
        """The payload of an entry signed for ``where``; None for one that is not (counted and logged as foreign)."""
        if entry is not None and len(entry) >= MAC_BYTES:
            payload = bytes(entry[MAC_BYTES:])
            if hmac.compare_digest(bytes(entry[:MAC_BYTES]), self._mac(where, payload)):
                return payload
        self.refused(f"{'/'.join(where)[:200]}: not signed by this run")
        return None

    def refused(self, what: str) -> None:
        self.foreign += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= LOGGED_EVERY:
            _log.warning("rlsync's Redis buffer %r refused %d foreign entr(ies) since the last line (the last: %s): an "
                         "entry this run did not sign (another process writes this Redis, or this process holds another "
                         "key: set the same RLSYNC_SECRET on every host of the run)", self.name, self._unlogged, what)
            self._logged_at, self._unlogged = now, 0
