"""The planner: balance over replicas, coalescing, bad input, fingerprints, real model shapes."""

from __future__ import annotations

import pytest

from rlsync import Box, LayoutError, PlanError, PlanMismatchError, Shard, TensorMeta, build_plan, make_layout
from rlsync.layouts import (
    data_parallel,
    engine_tp,
    from_state_dict,
    fsdp,
    load_model_spec,
    megatron,
    model_spec,
    replicated,
)

T = [TensorMeta("a", "bfloat16", (64, 8)), TensorMeta("b", "bfloat16", (16,))]


def test_replicas_share_the_sending_evenly() -> None:
    src = data_parallel(fsdp(T, 2), 4)  # 4 replicas of a 2-way shard: 8 senders
    dst = replicated(T, range(4))  # 4 receivers each need everything
    plan = build_plan(src, dst)
    st = plan.stats
    assert st.redundancy == 1.0
    assert st.senders == 8
    assert st.max_sender_bytes == st.sender_lower_bound == st.bytes_needed // 8
    assert st.imbalance == 1.0


def test_contiguous_pieces_coalesce_into_one_transfer() -> None:
    # Two tensors back to back in one buffer on both sides: one transfer, not two.
    src = make_layout(T, [Shard("a", Box.full((64, 8)), 0, "flat", 0, (8, 1)), Shard("b", Box.full((16,)), 0, "flat", 512, (1,))])
    dst = make_layout(T, [Shard("a", Box.full((64, 8)), 0, "flat", 0, (8, 1)), Shard("b", Box.full((16,)), 0, "flat", 512, (1,))])
    plan = build_plan(src, dst)
    assert len(plan.transfers) == 1
    assert plan.transfers[0].nbytes == (512 + 16) * 2
    assert list(plan.transfers[0].runs()) == [(0, 0, 1056)]


def test_dtype_mismatch_is_refused_before_planning() -> None:
    dst = from_state_dict([TensorMeta("a", "float32", (64, 8)), T[1]])
    with pytest.raises(PlanError, match=r"tensor 'a': source dtype bfloat16 != destination dtype float32"):
        build_plan(fsdp(T, 2), dst)


def test_unknown_destination_tensor_is_named() -> None:
    with pytest.raises(PlanError, match=r"1 destination tensor\(s\) the trainer does not export: 'c'\. The trainer exports 2"):
        build_plan(fsdp(T, 2), from_state_dict([*T, TensorMeta("c", "bfloat16", (2,))]))


def test_a_name_mismatch_lists_the_names_the_nearest_ones_and_a_prefix_that_explains_them() -> None:
    """A trainer whose names carry a wrapper's prefix (``linear.``): every missing name, the trainer's names, the
    nearest of each, and the prefix to strip."""
    engine = [TensorMeta(f"layers.{i}.weight", "float32", (4,)) for i in range(8)]
    trainer = [TensorMeta(f"linear.layers.{i}.weight", "float32", (4,)) for i in range(8)]
    with pytest.raises(PlanError) as raised:
        build_plan(from_state_dict(trainer), from_state_dict(engine))
    message = str(raised.value)
    assert "8 destination tensor(s) the trainer does not export: 'layers.0.weight'" in message and "and 3 more" in message
    assert "'layers.0.weight' ~ 'linear.layers.0.weight'" in message
    assert "the trainer's names carry the prefix 'linear.' that the others lack" in message


def test_a_destination_byte_no_source_holds_is_an_error() -> None:
    partial = make_layout(T, [Shard("a", Box((0, 0), (32, 8)), 0, "a", 0, (8, 1)), Shard("b", Box.full((16,)), 0, "b", 0, (1,))])
    with pytest.raises(PlanError, match=r"tensor 'a'.*cover 256 of its 512 elements; no source rank holds the rest"):
        build_plan(partial, from_state_dict(T))


def test_out_of_bounds_boxes_and_overflowing_buffers_are_errors() -> None:
    outside = make_layout(T[:1], [Shard("a", Box((60, 0), (8, 8)), 0, "a", 0, (8, 1))])
    with pytest.raises(LayoutError, match=r"source tensor 'a' on rank 0: box .* outside its shape"):
        build_plan(outside, from_state_dict(T[:1]))
    from rlsync import BufferSpec, Layout

    small = Layout(tuple(T[:1]), (Shard("a", Box.full((64, 8)), 0, "a", 0, (8, 1)),), (BufferSpec(0, "a", "bfloat16", 100),))
    with pytest.raises(LayoutError, match=r"overflow buffer 'a' of 100 elements"):
        build_plan(small, from_state_dict(T[:1]))


def test_partially_overlapping_sources_are_an_error() -> None:
    overlap = make_layout(T[:1], [
        Shard("a", Box((0, 0), (40, 8)), 0, "a", 0, (8, 1)),
        Shard("a", Box((30, 0), (34, 8)), 1, "a", 0, (8, 1)),
    ])
    with pytest.raises(LayoutError, match="overlap partially"):
        build_plan(overlap, from_state_dict(T[:1]))


def test_plan_refuses_other_layouts_naming_the_first_differing_tensor() -> None:
    src, dst = fsdp(T, 2), replicated(T, (0, 1))
    plan = build_plan(src, dst)
    plan.check(src, dst)
    other = fsdp([T[0], TensorMeta("b", "bfloat16", (16,))], 4)
    with pytest.raises(PlanMismatchError, match=r"another source layout: tensor 'a' differs"):
        plan.check(other, dst)
    with pytest.raises(PlanMismatchError, match=r"another destination layout: tensor 'c' is new"):
        plan.check(src, replicated([*T, TensorMeta("c", "bfloat16", (1,))], (0, 1)))


def test_fsdp_to_vllm_tp2_sends_each_rank_only_its_slices() -> None:
    spec = model_spec(dict(model_type="qwen2", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=64, vocab_size=100))
    plan = build_plan(fsdp(spec.tensors, 2), engine_tp(spec, 2))
    st = plan.stats
    assert st.redundancy == 1.0
    # each engine rank receives half of every split tensor plus every replicated one (norms)
    replicated_bytes = sum(p.meta.nbytes for p in spec.params if p.role == "replicated")
    assert st.bytes_needed == spec.nbytes + replicated_bytes


def test_kimi_k2_from_megatron_to_8_vllm_tp16_replicas_is_complete_and_balanced() -> None:
    spec = load_model_spec("kimi-k2")
    src, dst = megatron(spec, tp=8, pp=4, dp=8, ep=8), engine_tp(spec, tp=16, replicas=8)
    plan = build_plan(src, dst)
    st = plan.stats
    whole = sum(p.meta.nbytes * (16 if p.role in ("replicated", "mla_q_a", "mla_kv_a") else 1) for p in spec.params)
    assert st.bytes_needed == 8 * whole  # every TP rank holds its own copy of the replicated tensors
    assert st.redundancy == 1.0
    assert st.imbalance <= 1.05
    part = build_plan(src, dst, dst_ranks=[17])
    assert sorted(part.transfers, key=repr) == sorted(plan.for_dst_rank(17), key=repr)
