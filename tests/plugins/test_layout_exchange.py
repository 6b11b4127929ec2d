"""Readers publish their layout and learn the writers'; a restarted writer voids what its dead session
shared a version with; a writer posts to all its readers at once."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from _support.faulty_transports import flipping, writes_one_by_one

from rlsync import PlanError, SyncOptions, TensorMeta, WeightMismatchError, WeightsReader, WeightsWriter, reader_layout
from rlsync.layouts import from_state_dict, replicated
from rlsync.plugins import ShmTransport

PLAIN = [TensorMeta(f"layer{i}.weight", "bfloat16", (32, 16)) for i in range(3)] + [TensorMeta("norm.weight", "float32", (16,))]


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {m.name: torch.randn(m.shape, generator=gen).to(getattr(torch, m.dtype)) for m in PLAIN}


def test_a_writer_learns_the_destination_and_leaves_out_what_it_does_not_hold() -> None:
    """The trainer offers a tied alias (``lm_head.weight`` sharing layer0's storage, as ``state_dict()`` has it);
    the reader does not receive it, so it is never sent."""
    dst = from_state_dict(PLAIN)
    weights = state(1)
    offered = {**weights, "lm_head.weight": weights["layer0.weight"]}
    with WeightsReader(None, dst, 0) as reader:
        assert reader_layout(reader.address) == dst
        writer = WeightsWriter(from_state_dict(offered), None, 0, [reader.address], options=SyncOptions(timeout=10))
        assert writer.bytes_per_version == sum(m.nbytes for m in PLAIN)
        writer.multi_put(offered)
        writer.complete(1)
        assert reader.version == 1
        for name, tensor in weights.items():
            out = torch.empty_like(tensor)
            reader.get(name, out.view(torch.uint8).numpy())
            assert torch.equal(out, tensor), name
        writer.close()


def test_a_destination_tensor_the_trainer_lacks_is_an_error_before_any_byte() -> None:
    with WeightsReader(None, from_state_dict(PLAIN), 0) as reader:
        partial = {k: v for k, v in state(1).items() if k != "norm.weight"}
        with pytest.raises(PlanError, match="destination tensor\\(s\\) the trainer does not export: 'norm.weight'"):
            WeightsWriter(from_state_dict(partial), None, 0, [reader.address], options=SyncOptions(timeout=10))
        assert reader.version == -1


def test_a_restarted_writer_voids_its_dead_sessions_version_and_the_next_one_starts_clean(sync: Any) -> None:
    """Two trainer ranks; rank 0 finished its part of version 1, rank 1 hung midway (stopped: its connection stays
    open, so nothing tells the reader it is gone; a rank that dies is noticed at once, test_failures.py). When rank 1
    comes back in a new session, rank 0's part is discarded (it may pair with bytes rank 1 never finished) and rank 0
    is told; the version goes live only once both ranks of the new sessions sent it, with exactly their bytes."""
    src, dst = sync.layouts("two_writers")
    with WeightsReader(src, dst, 0, options=SyncOptions(transport="shm")) as reader:
        first = sync.writer("two_writers", "shm", {0: reader.address}, [1], rank=0, wait=False,
                            extra=("--timeout", "60"))
        hung = sync.writer("two_writers", "shm", {0: reader.address}, [1], rank=1, wait=False,
                           extra=("--die-after-writes", "2", "--hang"))
        assert os.WIFSTOPPED(os.waitpid(hung.pid, os.WUNTRACED)[1])
        deadline = time.monotonic() + 30
        while 0 not in reader._done and time.monotonic() < deadline:  # rank 0's part arrived and waits
            time.sleep(0.05)
        assert 0 in reader._done
        again = sync.writer("two_writers", "shm", {0: reader.address}, [1], rank=1, wait=False, extra=("--timeout", "60"))
        _, err = first.communicate(timeout=60)
        assert first.returncode != 0 and "discarded the parts of unfinished version 1 from writer ranks [0]" in err, err
        assert reader.version == -1 and reader.discarded == [1]
        resent = sync.writer("two_writers", "shm", {0: reader.address}, [1], rank=0)
        assert resent.returncode == 0, resent.stderr_text
        _, err = again.communicate(timeout=60)
        assert again.returncode == 0, err
        assert reader.version == 1 and reader.discarded == [1]
        sync.assert_landed("two_writers", reader, 1)
        hung.kill()


class _MeetingTransport(ShmTransport):
    """shm whose links wait, inside their first write, until every reader's link is writing: a writer that
    posted to its readers one after another would never get there (the barrier breaks after 10 s)."""

    name = "shm"
    barrier: threading.Barrier

    @classmethod
    def open(cls, description: dict[str, Any], options: dict[str, Any] | None = None) -> Any:
        link = ShmTransport.open(description, options)
        write = link.write

        def meet_then_write(source: np.ndarray, runs: Any) -> None:
            cls.barrier.wait()
            write(source, runs)

        link.write = meet_then_write  # type: ignore[method-assign]
        return writes_one_by_one(link)


def test_a_writer_posts_to_all_its_readers_at_once() -> None:
    readers = [WeightsReader(None, replicated(PLAIN, (0, 1, 2)), r) for r in range(3)]
    try:
        _MeetingTransport.barrier = threading.Barrier(3, timeout=10)
        writer = WeightsWriter(from_state_dict(PLAIN), None, 0, [r.address for r in readers], options=SyncOptions(transport=_MeetingTransport, timeout=20))
        writer.multi_put({k: v for k, v in state(2).items()})
        writer.complete(1)  # raises BrokenBarrierError if the readers were written one at a time
        assert [r.version for r in readers] == [1, 1, 1]
        writer.close()
    finally:
        for r in readers:
            r.close()


def test_replica_readers_take_their_layout_from_the_writers() -> None:
    """Readers that do not know the tensors yet (a verl rollout worker before the first sync): each holds a
    whole copy of what the writers send; two writer ranks each send half of every tensor."""
    from rlsync.layouts import fsdp

    readers = [WeightsReader(None, None, r, replicas=2) for r in range(2)]
    try:
        weights = state(3)
        src = fsdp(PLAIN, 2)
        writers = [WeightsWriter(src, None, w, [r.address for r in readers], options=SyncOptions(timeout=20)) for w in range(2)]
        assert {writer.next_version for writer in writers} == {0}  # nothing live yet
        for w, writer in enumerate(writers):
            writer.multi_put({m.name: weights[m.name].chunk(2)[w].contiguous() for m in PLAIN})
        threads = [threading.Thread(target=writer.complete, args=(1,)) for writer in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for reader in readers:
            assert reader.version == 1
            for name, tensor in weights.items():
                out = torch.empty_like(tensor)
                reader.get(name, out.view(torch.uint8).numpy())
                assert torch.equal(out, tensor), name
        later = WeightsWriter(src, None, 0, [r.address for r in readers], options=SyncOptions(timeout=20))
        assert later.next_version == 2  # a restarted trainer continues after the live version
        for writer in (*writers, later):
            writer.close()
    finally:
        for r in readers:
            r.close()


_target = [0]  # the address of the source buffer to corrupt
# shm that flips one bit of tensor ``layer1.weight`` on the way (a bad NIC, a bug in a copy)
_CorruptingTransport = flipping(ShmTransport, at=3, bit=1, applies=lambda source: source.ctypes.data == _target[0])


def test_checksums_name_the_tensor_that_arrived_wrong_and_the_version_stays_out() -> None:
    with WeightsReader(None, from_state_dict(PLAIN), 0, options=SyncOptions(verify=True)) as reader:
        writer = WeightsWriter(from_state_dict(PLAIN), None, 0, [reader.address], options=SyncOptions(verify=True, timeout=10))
        writer.multi_put(state(1))
        writer.complete(1)
        writer.close()
        bad = WeightsWriter(from_state_dict(PLAIN), None, 0, [reader.address], options=SyncOptions(verify=True, timeout=10, transport=_CorruptingTransport))
        bad.multi_put(state(2))
        _target[0] = bad._sources["layer1.weight"].data_ptr()
        with pytest.raises(WeightMismatchError, match=r"checksum mismatch in tensor 'layer1.weight' .*version 2"):
            bad.complete(2)
        assert reader.version == 1
        out = torch.empty_like(state(1)["layer1.weight"])
        reader.get("layer1.weight", out.view(torch.uint8).numpy())
        assert torch.equal(out, state(1)["layer1.weight"])
        bad.close()


def test_a_refused_version_reaches_the_engine_thread_at_once() -> None:
    """A staged reader whose engine thread waits in ``LandedVersions.next`` hears of a checksum refusal at once,
    instead of waiting for its timeout."""
    from rlsync import LandedVersions

    landed = LandedVersions()
    with WeightsReader(None, from_state_dict(PLAIN), 0, landing="staged", on_version=landed.on_version, on_refused=landed.on_refused, options=SyncOptions(verify=True)) as reader:
        bad = WeightsWriter(from_state_dict(PLAIN), None, 0, [reader.address], options=SyncOptions(verify=True, timeout=10, transport=_CorruptingTransport))
        bad.multi_put(state(2))
        _target[0] = bad._sources["layer1.weight"].data_ptr()
        errors: list[BaseException] = []

        def send() -> None:
            try:
                bad.complete(1)
            except WeightMismatchError as exc:
                errors.append(exc)

        sending = threading.Thread(target=send)
        sending.start()
        started = time.monotonic()
        with pytest.raises(WeightMismatchError, match="checksum mismatch in tensor 'layer1.weight'"):
            landed.next(timeout=60)
        assert time.monotonic() - started < 10
        sending.join(20)
        assert len(errors) == 1 and reader.version == -1
        bad.close()
