"""``rlsync.adapters.vllm.engine_layout``: the destination a trainer writes to (no vLLM needed)."""

from __future__ import annotations

import pytest

from rlsync.adapters.vllm import engine_layout
from rlsync.core._errors import ConfigError

TENSORS = [["a.weight", "torch.bfloat16", [8, 4]], ["lm_head.weight", "bfloat16", [8, 4]]]


def test_without_boxes_one_rank_receives_every_tensor_whole() -> None:
    layout = engine_layout(TENSORS)
    assert {(s.rank, s.tensor, s.box.sizes) for s in layout.shards} == {(0, "a.weight", (8, 4)), (0, "lm_head.weight", (8, 4))}


def test_boxes_give_each_rank_its_part_inside_whole_tensor_buffers() -> None:
    boxes = [{"a.weight": [[0, 0], [4, 4]], "lm_head.weight": [[0, 0], [8, 2]]},
             {"a.weight": [[4, 0], [4, 4]], "lm_head.weight": [[0, 2], [8, 2]]}]
    layout = engine_layout(TENSORS, boxes)
    by_rank = {(s.rank, s.tensor): (s.offset, s.strides) for s in layout.shards}
    assert by_rank[(1, "a.weight")] == (16, (4, 1))  # row 4 of a [8, 4] tensor
    assert by_rank[(1, "lm_head.weight")] == (2, (4, 1))  # column 2: strided inside the whole tensor
    assert all(b.numel == 32 for b in layout.buffers)


def test_a_tensor_no_worker_reads_is_named() -> None:
    with pytest.raises(ConfigError, match="lm_head.weight"):
        engine_layout(TENSORS, [{"a.weight": [[0, 0], [8, 4]]}])
