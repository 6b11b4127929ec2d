"""``rlsync.adapters.vllm.engine_layout``: the destination a trainer writes to (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlsync import Box, ConfigError, TensorMeta
from rlsync.adapters.vllm import engine_layout
from rlsync.layouts import SLACK, whole_tensor_view

TENSORS = [["a.weight", "torch.bfloat16", [8, 4]], ["lm_head.weight", "bfloat16", [8, 4]]]


def test_without_boxes_one_rank_receives_every_tensor_whole() -> None:
    layout = engine_layout(TENSORS)
    assert {(s.rank, s.tensor, s.box.sizes) for s in layout.shards} == {(0, "a.weight", (8, 4)), (0, "lm_head.weight", (8, 4))}


def test_boxes_give_each_rank_its_part_compactly_between_two_slack_buffers() -> None:
    boxes = [{"a.weight": [[0, 0], [4, 4]], "lm_head.weight": [[0, 0], [8, 2]]},
             {"a.weight": [[4, 0], [4, 4]], "lm_head.weight": [[0, 2], [8, 2]]}]
    layout = engine_layout(TENSORS, boxes)
    for rank in (0, 1):
        names = [(b.name, b.numel) for b in layout.buffers if b.rank == rank]
        assert names == [(SLACK[0], 64), ("a.weight", 16), ("lm_head.weight", 16), (SLACK[1], 64)]
    assert {(s.rank, s.tensor): s.box.offsets for s in layout.shards}[(1, "lm_head.weight")] == (0, 2)


def test_the_loader_sees_a_whole_tensor_whose_box_is_the_compact_buffer() -> None:
    """What vLLM's loader does with it: narrow to the worker's slice; it gets exactly the box."""
    meta = TensorMeta("w", "bfloat16", (6, 8))
    box = Box((0, 4), (6, 4))  # the second column half: strided inside the whole tensor
    region = np.zeros(256, np.uint8)
    whole = torch.arange(48, dtype=torch.float32).to(torch.bfloat16).view(6, 8)
    compact = whole[:, 4:].contiguous()
    region[128:176] = compact.view(torch.uint8).reshape(-1).numpy()
    view = whole_tensor_view(region, 128, meta, box)
    assert tuple(view.shape) == (6, 8)
    assert torch.equal(view.narrow(1, 4, 4), whole[:, 4:])
    row_box = Box((3, 0), (3, 8))
    region[128:176] = whole[3:].contiguous().view(torch.uint8).reshape(-1).numpy()
    assert torch.equal(whole_tensor_view(region, 128, meta, row_box).narrow(0, 3, 3), whole[3:])


def test_a_tensor_no_worker_reads_is_named() -> None:
    with pytest.raises(ConfigError, match="lm_head.weight"):
        engine_layout(TENSORS, [{"a.weight": [[0, 0], [8, 4]]}])
