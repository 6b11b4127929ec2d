"""A writer whose reader does not answer says so long before its timeout (issue #70), and tells a reader that is not
there (nothing listens: connection refused) from one that is slow (it accepted the connection)."""

from __future__ import annotations

import logging
import socket
import time

import pytest
import torch

from rlsync import SyncOptions, TransferTimeoutError, WeightsWriter
from rlsync.core import keyed
from rlsync.layouts import from_state_dict


def _writer(port: int) -> None:
    WeightsWriter(from_state_dict({"w": torch.zeros(4)}), None, 0, [keyed(f"tcp://127.0.0.1:{port}")],
                  options=SyncOptions(timeout=2.0))


@pytest.fixture(autouse=True)
def say_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlsync.core.sync import _control

    monkeypatch.setattr(_control, "SILENT_WAIT_S", 0.5)


def test_a_reader_that_is_not_there_is_named_as_such_before_the_timeout(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])  # closed again: nothing listens there
    started = time.time()
    with caplog.at_level(logging.WARNING, logger="rlsync"), pytest.raises(TransferTimeoutError, match="nothing listens"):
        _writer(port)
    said = [r for r in caplog.records if "no answer for" in r.getMessage()]
    assert len(said) == 1 and "nothing listens" in said[0].getMessage() and "still waiting" in said[0].getMessage()
    assert said[0].created - started < 1.5  # said after about 0.5 s, the error after 2


def test_a_reader_that_accepted_the_connection_and_is_slow_is_told_apart(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as listener:  # accepts TCP connections, never speaks
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with caplog.at_level(logging.WARNING, logger="rlsync"), \
                pytest.raises(TransferTimeoutError, match="accepted the connection but has not answered"):
            _writer(int(listener.getsockname()[1]))
    assert any("accepted the connection" in r.getMessage() for r in caplog.records)
