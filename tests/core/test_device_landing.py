"""Versions landing in device memory: the reader's regions are torch tensors (``Landing.memory == "device"``), so the
reader checks ``sum64`` checksums, applies deltas and hands out views as torch ops on that device. Here the
"device" is the CPU (``MemoryTransport`` with ``transport_options={"device": "cpu"}``): the same lines a GPU
landing runs (``cuda_ipc``, NIXL on VRAM), tested without one."""

from __future__ import annotations

import threading
import zlib

import numpy as np
import pytest
import torch
from _support.faulty_transports import flipping

from rlsync import StagedReceiver, SyncOptions, WeightMismatchError, WeightsReader, WeightsWriter
from rlsync.core import Checksums
from rlsync.layouts import from_state_dict
from rlsync.testing import MemoryTransport

DEVICE = {"device": "cpu"}


def _state(version: int, share: float = 0.02) -> dict[str, torch.Tensor]:
    """bf16 weights of which about ``share`` change from one version to the next (as an RL step does)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(33, generator=g)
    for k in range(2, version + 1):
        g = torch.Generator().manual_seed(k)
        w = torch.where(torch.rand(w.shape, generator=g) < share, w + 1, w)
        b = b + (torch.rand(b.shape, generator=g) < share) * 1.0
    return {"w": w.contiguous(), "b": b.contiguous()}


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("landing", ["direct", "staged"])
def test_delta_versions_with_checksums_land_bit_exact_in_device_memory(landing: str) -> None:
    layout = from_state_dict(_state(1))
    options = SyncOptions(transport=MemoryTransport, transport_options=DEVICE, verify=True)
    with WeightsReader(layout, layout, 0, options=options, landing=landing) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options.replace(wire="delta")) as writer:
        sent = []
        for version in (1, 2, 3, 4):
            state = _state(version)
            writer.multi_put(state)
            writer.complete(version)
            sent.append(writer.last_bytes)
            live = reader.buffers()
            assert reader.memory == "device" and all(isinstance(v, torch.Tensor) for v in live.values())
            for name, tensor in state.items():
                assert torch.equal(live[name], _raw(tensor)), f"{name} v{version}"
        assert writer._algorithms[0] == "sum64"  # the reader asked for the device checksum
        first_delta = 2 if landing == "direct" else 1  # direct: the second slot is first written by version 2
        assert all(0 < n < writer.bytes_per_version * 0.2 for n in sent[first_delta + 1 :]), sent


_FlippingTransport = flipping(MemoryTransport, at=1000, bit=4, applies=lambda source: len(source) == 256 * 64 * 2)  # tensor w


def test_a_bit_flipped_on_the_way_into_device_memory_is_refused_by_the_device_checksum() -> None:
    layout = from_state_dict(_state(1))
    good = SyncOptions(transport=MemoryTransport, transport_options=DEVICE, verify=True)
    with WeightsReader(layout, layout, 0, options=good) as reader:
        with WeightsWriter(layout, layout, 0, [reader.address], options=good) as writer:
            writer.multi_put(_state(1))
            writer.complete(1)
        with WeightsWriter(layout, layout, 0, [reader.address], options=good.replace(transport=_FlippingTransport)) as bad:
            bad.multi_put(_state(2))
            with pytest.raises(WeightMismatchError, match="checksum mismatch in tensor 'w'"):
                bad.complete(2)
        assert reader.version == 1 and torch.equal(reader.buffers()["w"], _raw(_state(1)["w"]))


def test_a_staged_receiver_on_device_memory_hands_the_loader_device_views_of_its_boxes() -> None:
    """Two engine ranks, each loading half of ``w`` (rows) and all of ``b``: the views are torch tensors over the
    device landing, whole-tensor shaped, and each rank's box holds the trainer's values."""
    state = _state(1)
    tensors = [[name, t.dtype, list(t.shape)] for name, t in state.items()]
    boxes = [{"w": [[0, 0], [128, 64]], "b": [[0], [33]]}, {"w": [[128, 0], [128, 64]], "b": [[0], [33]]}]
    options = SyncOptions(transport=MemoryTransport, transport_options=DEVICE)
    receivers = [StagedReceiver(tensors, boxes=boxes, rank=r, options=options) for r in (0, 1)]
    errors: list[BaseException] = []

    def train() -> None:
        try:
            with WeightsWriter(from_state_dict(state), None, 0, [r.address for r in receivers], options=options) as writer:
                writer.multi_put(state)
                writer.complete(1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        for rank, receiver in enumerate(receivers):
            version, views, finish = receiver.next(timeout=30)
            got = dict(views)
            finish(None)
            assert version == 1 and set(got) == {"w", "b"}
            rows = slice(128 * rank, 128 * (rank + 1))
            assert tuple(got["w"].shape) == (256, 64) and torch.equal(got["w"][rows], state["w"][rows])
            assert torch.equal(got["b"], state["b"])
            region = receiver.reader.region(0)
            assert isinstance(region, torch.Tensor) and got["w"].untyped_storage().data_ptr() == region.untyped_storage().data_ptr()
        trainer.join(30)
        assert not errors, errors
    finally:
        for receiver in receivers:
            receiver.close()


def test_sum64_is_the_same_whatever_the_alignment_and_changes_with_any_word_or_order() -> None:
    rng = np.random.default_rng(0)
    data = torch.from_numpy(rng.integers(0, 256, 4099, dtype=np.uint8))
    padded = torch.zeros(4099 + 3, dtype=torch.uint8)
    padded[3:] = data
    runs = [(0, 1000), (1000, 2048), (3048, 1051)]  # lengths: 4-byte, 4-byte and odd words

    def value(buffer: torch.Tensor, order: list[tuple[int, int]] = runs) -> int:
        sums = Checksums("sum64")
        sums.add("x", (buffer[s : s + n] for s, n in order))
        return sums.values["x"]

    base = value(data)
    assert value(padded[3:]) == base  # an odd address: same words, same sum
    flipped = data.clone()
    flipped[2500] ^= 1
    assert value(flipped) != base
    swapped = data.clone()
    swapped[[0, 4]] = data[[4, 0]]
    assert data[0] == data[4] or value(swapped) != base
    assert value(data, [runs[1], runs[0], runs[2]]) != base  # the runs' order counts
    crc = Checksums("crc32")
    crc.add("x", (data[s : s + n].numpy() for s, n in runs))
    assert crc.values["x"] == zlib.crc32(data.numpy().tobytes())
