"""What strangers may hold of a reader's file descriptors on its control port.

ZeroMQ accepts every TCP connection to a ROUTER and bounds none: idle connections that never finish the CURVE
handshake held a descriptor each for ``HANDSHAKE_MS``, so a stranger that kept opening them took every descriptor of
the engine process (its own ``open()`` then failed, and ZeroMQ's I/O thread spun on ``accept``'s EMFILE). ZeroMQ's
socket monitor names each accepted connection's descriptor, and every message says which descriptor it came on
(``ZMQ_SRCFD``): a connection is proven once a message arrives on it (only a holder of the key gets one through the
handshake), and while unproven ones hold more than an eighth of the process's descriptors (at most ``MAX_UNPROVEN``)
the oldest is shut down (``shutdown(2)``, never ``close``: the descriptor stays ZeroMQ's, which then closes it as
any dropped peer's). Before it is shut down a descriptor is checked to be still the same connection (its local port
and its peer), so a number ZeroMQ has reused meanwhile is left alone. An honest writer speaks within a round trip of
its connect, so it is the newest, not the oldest.

ZeroMQ accepts before rlsync sees a connection, so the budget acts within a service-loop turn (20 ms) of a burst, not
before it: a burst of more connections at once than the descriptors the process has left still runs it out for
that moment. So a reader also raises its process's soft descriptor limit to the hard one (at most ``RAISED_NOFILE``,
as vLLM does for its API server): a stranger then needs that many connections at once, each a descriptor of its own."""

from __future__ import annotations

import os
import resource
import socket
from collections import OrderedDict

MAX_UNPROVEN = 256
RAISED_NOFILE = 65536


def raise_descriptor_limit() -> None:
    """The process's soft descriptor limit up to its hard one (at most ``RAISED_NOFILE``); never lowered."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard if hard != resource.RLIM_INFINITY else RAISED_NOFILE, RAISED_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            pass  # a container may not allow it: the budget still holds strangers to an eighth


def connection_endpoints(fd: int) -> tuple[object, object] | None:
    """``(local, peer)`` address of the TCP connection on descriptor ``fd``, or None where it is not one now."""
    try:
        probe = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return probe.getsockname(), probe.getpeername()
    except OSError:
        return None
    finally:
        probe.close()  # the duplicate only: the connection stays ZeroMQ's


class StrangerBudget:
    """The unproven connections of one listening control socket, oldest first, bounded."""

    def __init__(self) -> None:
        raise_descriptor_limit()
        self.limit = min(MAX_UNPROVEN, max(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8))
        self._unproven: OrderedDict[int, tuple[object, object] | None] = OrderedDict()  # fd -> its endpoints
        self.turned_away = 0  # connections shut down because newer unproven ones were waiting

    def accepted(self, fd: int) -> None:
        self._unproven.pop(fd, None)
        self._unproven[fd] = connection_endpoints(fd)

    def proven(self, fd: int) -> None:
        self._unproven.pop(fd, None)

    def closed(self, fd: int) -> None:
        self._unproven.pop(fd, None)

    def enforce(self) -> None:
        """Shut down the oldest unproven connections beyond ``limit``."""
        while len(self._unproven) > self.limit:
            fd, endpoints = self._unproven.popitem(last=False)
            if endpoints is None or connection_endpoints(fd) != endpoints:
                continue  # gone, or the number is another connection's now
            try:
                probe = socket.socket(fileno=os.dup(fd))
            except OSError:
                continue
            try:
                probe.shutdown(socket.SHUT_RDWR)
                self.turned_away += 1
            except OSError:
                pass
            finally:
                probe.close()
