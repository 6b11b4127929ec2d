"""Tensors a host transport cannot read in place (device memory, strided views) go through host buffers the
writer allocates once and reuses: the same ``copy_`` line a GPU trainer's tensors take (``tests/gpu`` runs them
from CUDA)."""

from __future__ import annotations

import numpy as np
import torch

from rlsync import SyncOptions, WeightsReader, WeightsWriter
from rlsync.core import HostStaging
from rlsync.layouts import from_state_dict
from rlsync.testing import MemoryTransport


def test_strided_tensors_are_staged_once_and_land_exactly() -> None:
    base = {"w": torch.randn(16, 8), "b": torch.randn(5)}
    layout = from_state_dict({"w": base["w"].t(), "b": base["b"]})  # w is put as a transposed (strided) view
    options = SyncOptions(transport=MemoryTransport, timeout=20)
    with WeightsReader(layout, layout, 0, options=options) as reader, \
            WeightsWriter(layout, layout, 0, [reader.address], options=options) as writer:
        pointers = set()
        for version in (1, 2, 3):
            base["w"].normal_()
            view = base["w"].t()
            assert not view.is_contiguous()
            expected = view.contiguous().clone()
            writer.multi_put({"w": view, "b": base["b"]})
            pointers.add(writer._staging._buffers["w"].data_ptr())
            base["w"].zero_()  # a staged tensor was copied at put(): changing the source now changes nothing
            writer.complete(version)
            landed = reader.buffers()["w"].view(np.float32).reshape(8, 16)
            assert np.array_equal(landed, expected.numpy()) and expected.abs().sum() > 0
        assert len(pointers) == 1  # one host buffer, reused every version
        assert writer._staging.nbytes == 16 * 8 * 4


def test_staged_bytes_equal_the_source() -> None:
    staging = HostStaging()
    source = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)[:, ::2]
    staged = staging.stage("x", source)
    staging.wait()
    assert staged.is_contiguous() and torch.equal(staged, source)
    again = staging.stage("x", source * 2)
    assert again.data_ptr() == staged.data_ptr() and torch.equal(again, source * 2)
