"""Hostile peers, round 3 (issue #66): key holders (another process of the run, buggy or compromised) and readers that
steer their writer. Each test is one attack that cost the engine or the trainer something before its fix, judged by
what the engine serves, what the attack cost (log bytes, memory, files), and the next honest version landing."""

from __future__ import annotations

import logging
import os

import msgspec
import pytest
import torch

from _support.insider import Insider
from rlsync import SyncOptions, WeightsReader, WeightsWriter
from rlsync.layouts import from_state_dict

STATE = {"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8, dtype=torch.float32)}
LAYOUT = from_state_dict(STATE)


def honest_version(reader: WeightsReader, version: int, scale: float, options: SyncOptions | None = None) -> None:
    state = {n: t * scale for n, t in STATE.items()}
    with WeightsWriter(LAYOUT, None, 0, [reader.address], options=options or SyncOptions(timeout=20)) as writer:
        writer.multi_put(state)
        writer.complete(version)
    assert reader.version == version
    for name, tensor in state.items():
        assert bytes(reader.buffers()[name]) == tensor.numpy().tobytes(), name


def test_a_refused_hello_with_a_huge_name_costs_a_bounded_log_and_is_counted(caplog: pytest.LogCaptureFixture) -> None:
    """Item 10: a key holder's Hello naming a 1 MiB tensor, for another layout. Before: each refusal logged the name
    whole (1 MiB of log per message, 44-50 MiB/s) and was not counted in ``rejected``."""
    name = "x" * (1 << 20)
    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        honest_version(reader, 1, 1.0)
        caplog.set_level(logging.INFO, logger="rlsync")
        caplog.clear()
        for _ in range(20):
            peer = Insider(reader.address)
            peer.knock()
            peer.send({"type": "Hello", "writer_rank": 0, "src_fingerprint": "a", "dst_fingerprint": "b",
                       "dst_tensors": {name: "f"}, "session": "s"})
            answer = peer.answer()
            assert answer is not None and answer["type"] == "Refuse" and len(answer["reason"]) < 2000
            peer.close()
        logged = sum(len(r.getMessage()) for r in caplog.records)
        assert logged < 8192, logged  # at most a line per period, each with the reason cut short
        assert reader.rejected >= 20
        honest_version(reader, 2, 2.0)
