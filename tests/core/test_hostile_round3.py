"""Hostile peers, round 3 (issue #66): key holders (another process of the run, buggy or compromised) and readers that
steer their writer. Each test is one attack that cost the engine or the trainer something before its fix, judged by
what the engine serves, what the attack cost (log bytes, memory, files), and the next honest version landing."""

from __future__ import annotations

import logging
import os
import time

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


def _two_ranks() -> tuple[object, dict[int, dict[str, torch.Tensor]]]:
    """The source layout of two FSDP ranks (``Shard(0)``) and each rank's part of ``STATE * scale``."""
    from rlsync.layouts import fsdp

    src = fsdp(LAYOUT.tensors, 2)
    return src, {rank: {name: t.chunk(2)[rank].contiguous() for name, t in STATE.items()} for rank in (0, 1)}


def _complete_all(writers: list[WeightsWriter], version: int, scale: float) -> None:
    import threading

    errors: list[BaseException] = []

    def send(writer: WeightsWriter) -> None:
        try:
            writer.multi_put({n: t * scale for n, t in _two_ranks()[1][writer.rank].items()})
            writer.complete(version)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=send, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def _serves_whole(reader: WeightsReader, version: int, scale: float) -> None:
    assert reader.version == version
    for name, tensor in STATE.items():
        assert bytes(reader.buffers()[name]) == (tensor * scale).numpy().tobytes(), name


def test_a_ranks_tcp_link_writes_only_its_own_part_of_the_slot_being_written() -> None:
    """Item 8: writer rank 1 (a key holder that proved itself on the tcp landing) writes into rank 0's part of the
    slot being written after rank 0 finished, and into the live slot. Before: a mix went live with verify off (rank
    0's part held rank 1's bytes), and the live version's bytes changed with no version at all."""
    import threading

    import numpy as np

    from rlsync import RlsyncError

    tcp = SyncOptions(transport="tcp", timeout=8)
    src, _ = _two_ranks()
    with WeightsReader(None, LAYOUT, 0, options=tcp) as reader:
        writers = [WeightsWriter(src, None, r, [reader.address], options=tcp) for r in (0, 1)]  # type: ignore[arg-type]
        _complete_all(writers, 1, 1.0)
        _serves_whole(reader, 1, 1.0)
        garbage = np.full(4096, 0xAB, dtype=np.uint8)
        # version 2: rank 0 sends its part; then rank 1 writes over it before it sends its own
        writers[1].multi_put({n: t * 2.0 for n, t in _two_ranks()[1][1].items()})
        first: list[BaseException] = []
        rank0 = threading.Thread(target=lambda: _catch(first, lambda: _complete_all(writers[:1], 2, 2.0)))
        rank0.start()
        deadline = time.monotonic() + 10
        while 0 not in reader._done and time.monotonic() < deadline:
            time.sleep(0.01)
        theirs = writers[0]._runs[0][0][1][0]  # (src, dst, n) of rank 0's first run, which it has written
        link, slot = writers[1]._links[0], writers[1]._slots[0]
        try:
            link.write(garbage, [(0, slot, theirs[1], theirs[2])])
            link.flush()
            writers[1].complete(2)
        except RlsyncError:
            pass  # dropped at the write: rank 1's version cannot go on over this connection
        rank0.join(30)
        if reader.version == 2:  # never a mix: version 2 is the trainer's bytes, or it is not live
            _serves_whole(reader, 2, 2.0)
        else:
            _serves_whole(reader, 1, 1.0)
        for writer in writers:
            writer.close()

        # rank 1 again, from a new session: its own part, but of the live slot
        writers = [WeightsWriter(src, None, r, [reader.address], options=tcp) for r in (0, 1)]  # type: ignore[arg-type]
        served = reader.version, 2.0 if reader.version == 2 else 1.0
        writers[1]._connect(0)
        link, slot = writers[1]._links[0], writers[1]._slots[0]
        own = writers[1]._runs[0][0][1][0]
        with pytest.raises(RlsyncError):  # the connection is dropped at the write
            link.write(garbage, [(0, 1 - slot, own[1], own[2])])  # a direct landing: the other slot serves
            link.flush()
        _serves_whole(reader, *served)  # the live version's bytes did not move
        for writer in writers:
            writer.close()
        writers = [WeightsWriter(src, None, r, [reader.address], options=tcp) for r in (0, 1)]  # type: ignore[arg-type]
        _complete_all(writers, 3, 3.0)  # the next honest version lands exactly
        _serves_whole(reader, 3, 3.0)
        for writer in writers:
            writer.close()


def _catch(errors: list[BaseException], call: object) -> None:
    try:
        call()  # type: ignore[operator]
    except BaseException as exc:  # noqa: BLE001 - the caller looks
        errors.append(exc)


@pytest.mark.parametrize("verify", [False, True])
def test_one_ranks_own_credential_cannot_speak_for_another(verify: bool) -> None:
    """Item 9: each writer rank holds its own credential (``rank_address``, derived from the reader's key: a rank
    cannot compute another's). A writer with rank 1's credential that says it is rank 0 is refused, and the real
    rank 0 goes on. Before (one key for all): it finished rank 0's part of a version with its own bytes (under
    verify too), and the real rank 0 was refused after."""
    from rlsync import ConfigError, RlsyncError
    from rlsync.core import rank_address

    options = SyncOptions(timeout=6, verify=verify)
    src, _ = _two_ranks()
    with WeightsReader(None, LAYOUT, 0, options=options) as reader:
        own = [rank_address(reader.address, r) for r in (0, 1)]
        assert all("#" in a and reader.address.split("#")[1] not in a for a in own)  # the reader's key is in neither
        assert all(str(ConfigError(f"at {a}.")) == f"at {a.split('#')[0]}#<key>" for a in own)  # and neither prints
        writers = [WeightsWriter(src, None, r, [own[r]], options=options) for r in (0, 1)]  # type: ignore[arg-type]
        _complete_all(writers, 1, 1.0)
        _serves_whole(reader, 1, 1.0)
        with pytest.raises(Exception, match="writer rank 1's address"):  # the honest mistake, named at once
            WeightsWriter(src, None, 0, [own[1]], options=options)  # type: ignore[arg-type]
        impostor = WeightsWriter(src, None, 1, [own[1]], options=options)  # type: ignore[arg-type]
        impostor.rank = 0  # a compromised rank-1 process, speaking as rank 0
        impostor.multi_put({n: t * 9.0 for n, t in _two_ranks()[1][0].items()})
        rejected = reader.rejected
        with pytest.raises(RlsyncError):
            impostor.complete(2)
        assert reader.rejected > rejected and reader.version == 1
        impostor.close()
        _complete_all(writers, 2, 2.0)  # the real ranks' next version lands, exactly
        _serves_whole(reader, 2, 2.0)
        for writer in writers:
            writer.close()


def test_a_layout_larger_than_any_model_is_refused_before_it_is_planned_for() -> None:
    """Item 11: a key holder's 12 MiB AskLayout of 200,000 tiny tensors to a replica reader (one that learns its
    layout from its writers). Before: it cost the reader 511 MB and 16 s of its service thread, and was adopted (the
    trainer's own layout then refused). Now it is refused after its decode (under a second), nothing adopted."""
    import resource

    from rlsync.core import TensorMeta, replicated

    huge = replicated([TensorMeta(f"t{i}", "float32", (1,)) for i in range(200_000)], (0,))
    payload = msgspec.msgpack.encode({"type": "AskLayout", "src": msgspec.to_builtins(huge)})
    del huge
    with WeightsReader(None, None, 0, replicas=1) as reader:
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peer = Insider(reader.address)
        peer.knock()
        started = time.monotonic()
        peer.sock.send_multipart(peer.in_session(payload))
        answer = peer.answer(timeout_ms=60_000)
        assert answer is not None and answer["type"] == "Refuse" and "RLSYNC_MAX_PEER_TENSORS" in answer["reason"]
        assert time.monotonic() - started < 8
        assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown) / 1024 < 300  # MiB
        assert reader.dst is None and reader.plan is None
        peer.close()
        honest_version(reader, 1, 1.0)  # the trainer's layout is the one adopted
