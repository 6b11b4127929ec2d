"""Exact tests of each layout builder: which rank holds which box, where in which buffer."""

from __future__ import annotations

import numpy as np
import pytest

from rlsync import Box, LayoutError, TensorMeta
from rlsync.layouts import (
    PRESETS,
    allocate,
    chunk_bounds,
    data_parallel,
    engine_tp,
    flat_partitions,
    flat_range_boxes,
    fsdp,
    gather_shards,
    load_model_spec,
    megatron,
    model_spec,
    replicated,
    scatter,
    tied_aliases,
    zero3,
)

TINY_GQA = dict(model_type="qwen2", hidden_size=16, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=24, vocab_size=40, tie_word_embeddings=False)
TINY_MOE = dict(model_type="qwen3_moe", hidden_size=16, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, head_dim=4, intermediate_size=32, moe_intermediate_size=8,
                num_experts=4, vocab_size=32, tie_word_embeddings=False)


def _by(layout, tensor):  # type: ignore[no-untyped-def]
    return sorted((s for s in layout.shards if s.tensor == tensor), key=lambda s: (s.rank, s.box.offsets))


def test_fsdp_uneven_last_shard_follows_torch_chunk() -> None:
    t = TensorMeta("w", "float32", (10, 3))
    layout = fsdp([t], 4)
    assert [(s.rank, s.box.offsets, s.box.sizes) for s in _by(layout, "w")] == [
        (0, (0, 0), (3, 3)), (1, (3, 0), (3, 3)), (2, (6, 0), (3, 3)), (3, (9, 0), (1, 3)),
    ]
    # like torch.chunk(torch.empty(3), 5): ranks 3 and 4 hold nothing
    assert chunk_bounds(3, 5) == [(0, 1), (1, 2), (2, 3), (3, 3), (3, 3)]
    small = fsdp([TensorMeta("b", "float32", (3,))], 5)
    assert sorted(s.rank for s in small.shards) == [0, 1, 2]


def test_zero3_flat_partitions_are_boxes_at_the_right_offsets() -> None:
    a, b = TensorMeta("a", "float32", (3, 4)), TensorMeta("b", "float32", (5,))
    layout = zero3([a, b], 2)
    # a: 12 elements -> 6 per rank; b: 5 elements -> 3 per rank (padded), after a's partition
    assert [(s.rank, s.box, s.offset) for s in _by(layout, "a")] == [
        (0, Box((0, 0), (1, 4)), 0), (0, Box((1, 0), (1, 2)), 4),
        (1, Box((1, 2), (1, 2)), 0), (1, Box((2, 0), (1, 4)), 2),
    ]
    assert [(s.rank, s.box, s.offset) for s in _by(layout, "b")] == [(0, Box((0,), (3,)), 6), (1, Box((3,), (2,)), 6)]
    assert {(buf.rank, buf.numel) for buf in layout.buffers} == {(0, 9), (1, 9)}


def test_flat_partitions_put_each_ranks_part_in_a_buffer_of_its_own() -> None:
    a, b = TensorMeta("a", "float32", (3, 4)), TensorMeta("b", "float32", (2,))
    layout = flat_partitions([a, b], 3)
    # a: 12 elements -> 4 per rank; b: 2 elements -> 1 per rank, rank 2 holds none of it
    assert [(s.rank, s.box, s.buffer, s.offset) for s in _by(layout, "a")] == [
        (0, Box((0, 0), (1, 4)), "a", 0), (1, Box((1, 0), (1, 4)), "a", 0), (2, Box((2, 0), (1, 4)), "a", 0),
    ]
    assert [(s.rank, s.box, s.buffer, s.offset) for s in _by(layout, "b")] == [(0, Box((0,), (1,)), "b", 0), (1, Box((1,), (1,)), "b", 0)]
    assert sorted((buf.rank, buf.name, buf.numel) for buf in layout.buffers) == [
        (0, "a", 4), (0, "b", 1), (1, "a", 4), (1, "b", 1), (2, "a", 4)]
    # a part that starts mid-row: the second box sits after the first in the rank's buffer
    odd = flat_partitions([TensorMeta("c", "float32", (3, 4))], 2)
    assert [(s.rank, s.box, s.offset) for s in _by(odd, "c")] == [
        (0, Box((0, 0), (1, 4)), 0), (0, Box((1, 0), (1, 2)), 4), (1, Box((1, 2), (1, 2)), 0), (1, Box((2, 0), (1, 4)), 2)]
    whole = np.arange(12, dtype=np.float32).reshape(3, 4)
    parts = {r: whole.ravel()[r * 6:(r + 1) * 6] for r in range(2)}
    for s in _by(odd, "c"):  # each box's elements are where the shard says in the rank's part
        got = np.lib.stride_tricks.as_strided(parts[s.rank][s.offset:], shape=s.box.sizes, strides=[4 * x for x in s.strides])
        region = tuple(slice(o, o + n) for o, n in zip(s.box.offsets, s.box.sizes))
        assert np.array_equal(got, whole[region])


def test_flat_range_boxes_cover_exactly_the_range() -> None:
    shape = (3, 4, 5)
    for lo, hi in [(0, 60), (7, 53), (19, 21), (20, 40), (59, 60)]:
        mask = np.zeros(shape, bool)
        for box in flat_range_boxes(shape, lo, hi):
            region = tuple(slice(o, o + n) for o, n in zip(box.offsets, box.sizes))
            assert not mask[region].any()
            mask[region] = True
        assert np.flatnonzero(mask.ravel()).tolist() == list(range(lo, hi))


def test_replicated_and_data_parallel() -> None:
    t = TensorMeta("w", "bfloat16", (2, 2))
    layout = data_parallel(fsdp([t], 2), 3)
    assert sorted((s.rank, s.box.offsets) for s in layout.shards) == [
        (0, (0, 0)), (1, (1, 0)), (2, (0, 0)), (3, (1, 0)), (4, (0, 0)), (5, (1, 0)),
    ]
    assert {s.rank for s in replicated([t], (0, 3)).shards} == {0, 3}


def test_engine_qkv_with_fewer_kv_heads_than_tp_replicates_them() -> None:
    spec = model_spec(TINY_GQA)  # 8 q heads, 2 kv heads, head_dim 2, tp 4
    layout = engine_tp(spec, tp=4)
    q, k = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"
    v = "model.layers.0.self_attn.v_proj.weight"
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert [(s.rank, s.box.offsets[0], s.box.sizes[0], s.buffer, s.offset) for s in _by(layout, q)] == [
        (r, 4 * r, 4, qkv, 0) for r in range(4)  # 2 q heads of dim 2 per rank, first in the buffer
    ]
    # kv head 0 on ranks 0 and 1, head 1 on ranks 2 and 3; k after q (row 4), v after k (row 6)
    assert [(s.rank, s.box.offsets[0], s.offset) for s in _by(layout, k)] == [(0, 0, 64), (1, 0, 64), (2, 2, 64), (3, 2, 64)]
    assert [(s.rank, s.box.offsets[0], s.offset) for s in _by(layout, v)] == [(0, 0, 96), (1, 0, 96), (2, 2, 96), (3, 2, 96)]
    assert {(b.rank, b.numel) for b in layout.buffers if b.name == qkv} == {(r, 8 * 16) for r in range(4)}
    # qwen2 has q/k/v biases, fused the same way
    kb = _by(layout, "model.layers.0.self_attn.k_proj.bias")
    assert [(s.rank, s.box.offsets, s.offset) for s in kb] == [(0, (0,), 4), (1, (0,), 4), (2, (2,), 4), (3, (2,), 4)]


def test_engine_gate_up_and_row_parallel() -> None:
    spec = model_spec(TINY_GQA)
    layout = engine_tp(spec, tp=2)
    up = _by(layout, "model.layers.1.mlp.up_proj.weight")
    assert [(s.rank, s.box.offsets, s.buffer, s.offset) for s in up] == [
        (0, (0, 0), "model.layers.1.mlp.gate_up_proj.weight", 12 * 16),
        (1, (12, 0), "model.layers.1.mlp.gate_up_proj.weight", 12 * 16),
    ]
    down = _by(layout, "model.layers.1.mlp.down_proj.weight")
    assert [(s.rank, s.box.offsets, s.box.sizes) for s in down] == [(0, (0, 0), (16, 12)), (1, (0, 12), (16, 12))]
    emb = _by(layout, "model.embed_tokens.weight")  # vocab-parallel
    assert [(s.rank, s.box.offsets, s.box.sizes) for s in emb] == [(0, (0, 0), (20, 16)), (1, (20, 0), (20, 16))]


def test_engine_stacks_experts_into_w13_and_w2() -> None:
    spec = model_spec(TINY_MOE)  # 4 experts, moe_intermediate 8, hidden 16
    layout = engine_tp(spec, tp=2)
    w13 = "model.layers.0.mlp.experts.w13_weight"
    gate = _by(layout, "model.layers.0.mlp.experts.gate_proj.weight")
    up = _by(layout, "model.layers.0.mlp.experts.up_proj.weight")
    assert [(s.rank, s.box, s.buffer, s.offset, s.strides) for s in gate] == [
        (0, Box((0, 0, 0), (4, 4, 16)), w13, 0, (8 * 16, 16, 1)),
        (1, Box((0, 4, 0), (4, 4, 16)), w13, 0, (8 * 16, 16, 1)),
    ]
    assert [s.offset for s in up] == [4 * 16, 4 * 16]
    down = _by(layout, "model.layers.0.mlp.experts.down_proj.weight")
    assert [(s.rank, s.box) for s in down] == [(0, Box((0, 0, 0), (4, 16, 4))), (1, Box((0, 0, 4), (4, 16, 4)))]


def test_megatron_qkv_interleaves_query_groups() -> None:
    spec = model_spec({**TINY_GQA, "num_key_value_heads": 4})  # 8 q heads, 4 groups of 2, head_dim 2
    layout = megatron(spec, tp=2)
    buf = "model.layers.0.self_attention.linear_qkv.weight"
    q = [(s.rank, s.box.offsets[0], s.offset // 16) for s in _by(layout, "model.layers.0.self_attn.q_proj.weight")]
    k = [(s.rank, s.box.offsets[0], s.offset // 16) for s in _by(layout, "model.layers.0.self_attn.k_proj.weight")]
    # rank 0 holds groups 0, 1: rows [q0 q0 q0 q0 k0 k0 v0 v0 | q1 ... ]
    assert q == [(0, 0, 0), (0, 4, 8), (1, 8, 0), (1, 12, 8)]
    assert k == [(0, 0, 4), (0, 2, 12), (1, 4, 4), (1, 6, 12)]
    assert {s.buffer for s in layout.shards if "self_attn.v_proj.weight" in s.tensor} == {buf, buf.replace("layers.0", "layers.1")}
    with pytest.raises(LayoutError, match="num_key_value_heads"):
        megatron(model_spec(TINY_GQA), tp=4)


def test_megatron_pipeline_and_expert_parallel() -> None:
    spec = model_spec(TINY_MOE)  # 4 layers, 4 experts
    layout = megatron(spec, tp=1, pp=2, dp=2, ep=2)  # ranks: (pp0: 0, 1), (pp1: 2, 3)
    ranks = lambda name: sorted({s.rank for s in layout.shards if s.tensor == name})  # noqa: E731
    assert ranks("model.embed_tokens.weight") == [0, 1]
    assert ranks("lm_head.weight") == [2, 3]
    assert ranks("model.layers.1.input_layernorm.weight") == [0, 1]
    assert ranks("model.layers.2.input_layernorm.weight") == [2, 3]
    experts = _by(layout, "model.layers.3.mlp.experts.gate_proj.weight")
    assert [(s.rank, s.box.offsets[0], s.box.sizes[0]) for s in experts] == [(2, 0, 2), (3, 2, 2)]
    # expert-tensor-parallel: tp=2, etp=2 splits each expert's intermediate dim as well
    etp = megatron(spec, tp=2, pp=1, dp=2, ep=2)
    boxes = [(s.rank, s.box.offsets, s.box.sizes) for s in _by(etp, "model.layers.0.mlp.experts.up_proj.weight")]
    assert boxes == [(0, (0, 0, 0), (2, 4, 16)), (1, (0, 4, 0), (2, 4, 16)), (2, (2, 0, 0), (2, 4, 16)), (3, (2, 4, 0), (2, 4, 16))]


def test_builders_place_every_element_where_the_engine_reads_it() -> None:
    """Scatter a tiny model into the fused vLLM layout and read the fused buffer like vLLM does."""
    spec = model_spec(TINY_GQA)
    layout = engine_tp(spec, tp=2)
    rng = np.random.default_rng(1)
    values = {p.meta.name: rng.integers(0, 2**16, size=p.meta.shape, dtype=np.uint16) for p in spec.params}
    bufs = allocate(layout, 1)
    scatter(layout, 1, values, bufs)
    qkv = bufs["model.layers.0.self_attn.qkv_proj.weight"].view(np.uint16).reshape(-1, 16)
    p = "model.layers.0.self_attn."
    expected = np.concatenate([values[p + "q_proj.weight"][8:16], values[p + "k_proj.weight"][2:4], values[p + "v_proj.weight"][2:4]])
    np.testing.assert_array_equal(qkv, expected)
    for shard, view in gather_shards(layout, 1, bufs):
        region = tuple(slice(o, o + n) for o, n in zip(shard.box.offsets, shard.box.sizes))
        np.testing.assert_array_equal(view, values[shard.tensor][region])


def test_presets_match_published_parameter_counts() -> None:
    counts = {name: load_model_spec(name).numel for name in PRESETS}
    assert round(counts["qwen2.5-7b"] / 1e9, 2) == 7.62
    assert round(counts["llama3-8b"] / 1e9, 2) == 8.03
    assert round(counts["qwen3-30b-a3b"] / 1e9, 1) == 30.5
    assert 1.0e12 < counts["kimi-k2"] < 1.05e12
    kimi = load_model_spec("kimi-k2")
    names = {p.meta.name: p.meta.shape for p in kimi.params}
    assert names["model.layers.0.mlp.gate_proj.weight"] == (18432, 7168)  # first layer dense
    assert names["model.layers.1.mlp.experts.gate_proj.weight"] == (384, 2048, 7168)
    assert names["model.layers.1.mlp.shared_experts.down_proj.weight"] == (7168, 2048)
    assert names["model.layers.5.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert names["model.layers.5.self_attn.q_b_proj.weight"] == (64 * 192, 1536)
    assert names["lm_head.weight"] == (163840, 7168)


def test_tied_aliases_are_the_second_names_of_one_memory() -> None:
    import torch

    embed = torch.randn(8, 4)
    state = {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "norm.weight": torch.ones(4),
             "copy.weight": embed.clone(), "first_row": embed[0], "transposed": embed.t()}
    assert tied_aliases(state) == {"lm_head.weight"}  # a copy, a part or a view in another shape is not
