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


def test_a_writer_opens_no_file_a_reader_names_and_sizes_nothing_by_its_word(tmp_path: pytest.TempPathFactory) -> None:
    """Item 12: a reader (a key holder, or a buggy engine) steers its writer. Before: a Welcome naming ``paths`` made
    the trainer open and overwrite that file with its weights; a claimed ``inbox_capacity`` of 2^40 made it allocate
    1 TiB for its delta staging."""
    from rlsync import RlsyncError, TransportError

    victim = tmp_path / "config.json"  # type: ignore[operator]
    with WeightsReader(LAYOUT, LAYOUT, 0) as reader:
        honest = reader._landing.describe()  # type: ignore[union-attr]
        config = '{"model_type": "qwen2"}'.ljust(honest["nbytes"])  # as long as the landing: mapped whole before
        victim.write_text(config)
        for claim in ({**honest, "paths": [str(victim)] * len(honest["paths"])},  # a file of the reader's choosing
                      {**honest, "paths": ["/dev/shm/../" + str(victim)]},
                      {**honest, "nbytes": honest["nbytes"] * 4}):  # a size other than the plan's
            reader._landing.describe = lambda claim=claim: claim  # type: ignore[union-attr,method-assign]
            with pytest.raises(TransportError, match="refused"):
                honest_version(reader, 1, 1.0)
        assert victim.read_text() == config
        reader._landing.describe = lambda: honest  # type: ignore[union-attr,method-assign]
        honest_version(reader, 1, 1.0)

    delta = SyncOptions(timeout=20, wire="delta")
    with WeightsReader(LAYOUT, LAYOUT, 0, options=delta) as reader:
        opened = reader._open_inbox

        honest_parts: dict[int, tuple[int, int]] = {}

        def claims_a_tebibyte() -> object:
            inbox = opened()
            honest_parts.update(reader._inbox_parts)
            reader._inbox_parts[0] = (0, 1 << 40)
            return inbox

        reader._open_inbox = claims_a_tebibyte  # type: ignore[method-assign]
        with pytest.raises(RlsyncError, match="inbox part of 1099511627776 bytes"):
            honest_version(reader, 1, 1.0, delta)
        reader._open_inbox = opened  # type: ignore[method-assign]
        reader._inbox_parts.update(honest_parts)
        honest_version(reader, 1, 1.0, delta)
        honest_version(reader, 2, 2.0, delta)
