"""Which writers' control connections closed, from a reader's ZeroMQ socket monitor.

A writer killed in the middle of a version (an OOM-killed trainer rank) says nothing more: without this, the engine
waited out its whole timeout (300 s by default) for bytes that would not come, in place with its generation paused.
Its kernel closes the writer's TCP connection at once, and ZeroMQ's monitor reports that as ``EVENT_DISCONNECTED``
with the connection's descriptor; every message says which descriptor it came on (``ZMQ_SRCFD``). So the reader
notes the descriptor of each peer that spoke in a session, and a closed descriptor names the peer that lost it.

ZeroMQ reuses descriptor numbers, and the monitor's events reach the reader apart from the messages: when a closed
number is reported, the peer noted on it is lost only if that descriptor is no longer the connection it spoke on (its
local port and its peer: ``connection_endpoints``); a number checked while ZeroMQ has not yet closed it is looked at
again on the next turns, for ``CLOSING_S``."""

from __future__ import annotations

import time

from rlsync.core.sync._stranger_budget import connection_endpoints

CLOSING_S = 1.0  # how long a reported descriptor that still looks like its connection is looked at again


class PeerConnections:
    """The descriptor each authenticated peer last spoke on; ``lost()``: peers whose connection closed since."""

    def __init__(self) -> None:
        self._spoke_on: dict[int, tuple[bytes, object]] = {}  # descriptor -> (peer identity, its endpoints)
        self._closing: dict[int, float] = {}  # descriptors reported closed, not yet seen closed -> when to stop looking

    def spoke(self, fd: int, identity: bytes) -> None:
        """``identity`` sent an authenticated message on descriptor ``fd`` (a stranger's are never noted: the map holds
        peers that proved the key, one entry a descriptor)."""
        noted = self._spoke_on.get(fd)
        if noted is None or noted[0] != identity:
            self._spoke_on[fd] = (identity, connection_endpoints(fd))

    def closed(self, fd: int) -> None:
        """The monitor reported descriptor ``fd``'s connection closed."""
        if fd in self._spoke_on:
            self._closing[fd] = time.monotonic() + CLOSING_S

    def lost(self) -> list[bytes]:
        """The peers whose connection is gone since the last call."""
        gone = []
        now = time.monotonic()
        for fd, until in list(self._closing.items()):
            identity, endpoints = self._spoke_on[fd]
            if endpoints is None or connection_endpoints(fd) != endpoints:  # closed, or another connection's number now
                gone.append(identity)
                del self._spoke_on[fd], self._closing[fd]
            elif now > until:  # still its connection: the report was of an earlier one on the same number
                del self._closing[fd]
        return gone
