"""A reader names the peers whose control connection closed from ZeroMQ's reports of closed descriptors
(``rlsync.core.sync._peer_connections``): a descriptor number reported closed that is still the connection its peer
spoke on names nobody, and one that another connection took meanwhile names the peer that lost it."""

from __future__ import annotations

import socket
import time

import pytest

from rlsync.core.sync import _peer_connections
from rlsync.core.sync._peer_connections import PeerConnections


def _connection(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return client, accepted


def test_a_closed_connection_names_its_peer_once_and_an_earlier_ones_report_names_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_peer_connections, "CLOSING_S", 0.05)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client, accepted = _connection(listener)
        peers = PeerConnections()
        peers.spoke(accepted.fileno(), b"writer-a")
        peers.closed(accepted.fileno())  # a report of an earlier connection on this number: this one is alive
        assert peers.lost() == []
        time.sleep(0.1)
        assert peers.lost() == []  # looked at for CLOSING_S, then forgotten: the peer still speaks
        peers.closed(accepted.fileno())
        accepted.close()
        client.close()
        assert peers.lost() == [b"writer-a"] and peers.lost() == []


def test_a_number_another_connection_took_names_the_peer_that_lost_it() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client, accepted = _connection(listener)
        peers = PeerConnections()
        fd = accepted.fileno()
        peers.spoke(fd, b"writer-a")
        accepted.close()
        client.close()
        other_client, other = _connection(listener)  # the lowest free number: most likely the same one
        try:
            peers.closed(fd)
            assert peers.lost() == [b"writer-a"]
        finally:
            other.close()
            other_client.close()
