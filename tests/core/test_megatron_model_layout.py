"""``rlsync.layouts.from_megatron`` without megatron-core (duck-typed: a config and parameter shapes, as a live
``GPTModel`` gives them; ``tests/adapters/megatron`` runs the real one): it agrees with the builder ``rlsync plan
--train megatron:...`` uses, trims megatron's vocabulary padding, and refuses what it does not describe by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlsync import build_plan
from rlsync.core import LayoutError
from rlsync.layouts import engine_tp, from_megatron, megatron, model_spec

CONFIG = SimpleNamespace(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                         kv_channels=16, gated_linear_unit=True, normalization="RMSNorm", add_qkv_bias=False,
                         num_moe_experts=None)
HF = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "intermediate_size": 128, "num_hidden_layers": 4, "vocab_size": 256, "tie_word_embeddings": False,
      "torch_dtype": "bfloat16"}


def _params(tp: int, tp_rank: int, pp: int, pp_rank: int, vocab_rows: int) -> dict[str, SimpleNamespace]:
    """The parameters megatron-core's local spec gives this rank (names and shapes as named_parameters() lists them)."""
    def p(*shape: int) -> SimpleNamespace:
        return SimpleNamespace(shape=shape, dtype="bfloat16")

    out = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = p(vocab_rows // tp, 64)
    for i in range(4 // pp):
        out.update({f"decoder.layers.{i}.input_layernorm.weight": p(64),
                    f"decoder.layers.{i}.self_attention.linear_qkv.weight": p((4 + 2 * 2) * 16 // tp, 64),
                    f"decoder.layers.{i}.self_attention.linear_proj.weight": p(64, 64 // tp),
                    f"decoder.layers.{i}.pre_mlp_layernorm.weight": p(64),
                    f"decoder.layers.{i}.mlp.linear_fc1.weight": p(2 * 128 // tp, 64),
                    f"decoder.layers.{i}.mlp.linear_fc2.weight": p(64, 128 // tp)})
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = p(64)
        out["output_layer.weight"] = p(vocab_rows // tp, 64)
    return out


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_the_live_layout_plans_as_the_builder_rlsync_plan_uses(tp: int, pp: int) -> None:
    spec = model_spec(HF)
    built = megatron(spec, tp=tp, pp=pp)
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            live = from_megatron(_params(tp, tp_rank, pp, pp_rank, 256), CONFIG, padded_vocab_size=256, tp=tp,
                                 tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)
            assert {(s.tensor, s.box, s.rank) for s in live.shards} == {(s.tensor, s.box, s.rank) for s in built.shards}
    engine = engine_tp(spec, tp=2)
    assert build_plan(live, engine).stats.bytes_sent == build_plan(built, engine).stats.bytes_sent


def test_megatrons_vocabulary_padding_stays_on_the_trainer() -> None:
    """A vocabulary of 250 padded to 256 over tp=2: rank 0 holds rows 0-127, rank 1 rows 128-249 of the checkpoint's
    and 6 padding rows, never sent; each rank's buffer is its whole padded parameter."""
    layouts = [from_megatron(_params(2, r, 1, 0, 256), CONFIG, padded_vocab_size=256, vocab_size=250, tp=2, tp_rank=r)
               for r in range(2)]
    layout = layouts[0]
    boxes = {s.rank: s.box for s in layout.shards if s.tensor == "model.embed_tokens.weight"}
    assert boxes[0].offsets == (0, 0) and boxes[0].sizes == (128, 64)
    assert boxes[1].offsets == (128, 0) and boxes[1].sizes == (122, 64)
    assert {b.rank: b.numel for b in layout.buffers if b.name == "output_layer.weight"} == {0: 128 * 64, 1: 128 * 64}
    assert next(t for t in layout.tensors if t.name == "lm_head.weight").shape == (250, 64)


def test_what_it_does_not_describe_is_refused_by_name() -> None:
    params = _params(2, 0, 1, 0, 256)
    with pytest.raises(LayoutError, match="MoE"):
        from_megatron(params, SimpleNamespace(**{**vars(CONFIG), "num_moe_experts": 8}), padded_vocab_size=256, tp=2)
    wrong = {**params, "decoder.layers.0.mlp.linear_fc1.weight": SimpleNamespace(shape=(64, 64), dtype="bfloat16")}
    with pytest.raises(LayoutError, match=r"'decoder.layers.0.mlp.linear_fc1.weight' has shape \(64, 64\)"):
        from_megatron(wrong, CONFIG, padded_vocab_size=256, tp=2)
    extra = {**params, "decoder.layers.0.self_attention.linear_qkv.lora_a": SimpleNamespace(shape=(4, 64), dtype="bfloat16")}
    with pytest.raises(LayoutError, match="linear_qkv.lora_a"):
        from_megatron(extra, CONFIG, padded_vocab_size=256, tp=2)
    with pytest.raises(LayoutError, match="even split"):
        from_megatron(_params(1, 0, 1, 0, 256), SimpleNamespace(**{**vars(CONFIG), "num_layers": 3}), padded_vocab_size=256, pp=2)


def _moe_params(ep_rank: int, ep: int) -> dict[str, SimpleNamespace]:
    """A Qwen3-MoE-like rank of megatron-core's local spec: 8 experts of 32, their local ones under SequentialMLP."""
    def p(*shape: int) -> SimpleNamespace:
        return SimpleNamespace(shape=shape, dtype="bfloat16")

    out = {"embedding.word_embeddings.weight": p(256, 64), "decoder.final_layernorm.weight": p(64),
           "output_layer.weight": p(256, 64)}
    for i in range(4):
        out.update({f"decoder.layers.{i}.input_layernorm.weight": p(64),
                    f"decoder.layers.{i}.self_attention.linear_qkv.weight": p((4 + 2 * 2) * 16, 64),
                    f"decoder.layers.{i}.self_attention.q_layernorm.weight": p(16),
                    f"decoder.layers.{i}.self_attention.k_layernorm.weight": p(16),
                    f"decoder.layers.{i}.self_attention.linear_proj.weight": p(64, 64),
                    f"decoder.layers.{i}.pre_mlp_layernorm.weight": p(64),
                    f"decoder.layers.{i}.mlp.router.weight": p(8, 64)})
        for j in range(8 // ep):
            out[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc1.weight"] = p(2 * 32, 64)
            out[f"decoder.layers.{i}.mlp.experts.local_experts.{j}.linear_fc2.weight"] = p(64, 32)
    return out


MOE = SimpleNamespace(**{**vars(CONFIG), "num_moe_experts": 8, "moe_ffn_hidden_size": 32, "moe_router_topk": 2,
                         "qk_layernorm": True})


def test_a_moe_rank_holds_its_own_experts_under_the_checkpoints_names_and_sends_what_the_builder_plans() -> None:
    """Experts over ep=2 (of dp=2): rank r's local expert j is the checkpoint's expert 4r + j; the attention comes from
    either; the bytes are those of ``megatron(spec, dp=2, ep=2)``, which ``rlsync plan`` uses (stacked experts)."""
    layouts = [from_megatron(_moe_params(r, 2), MOE, padded_vocab_size=256, dp=2, dp_rank=r, ep=2, ep_rank=r)
               for r in range(2)]
    live = layouts[1]
    owners = {s.tensor: s.rank for s in live.shards if ".experts." in s.tensor}
    assert owners["model.layers.3.mlp.experts.5.down_proj.weight"] == 1
    assert owners["model.layers.0.mlp.experts.3.gate_proj.weight"] == 0
    fc1 = {s.tensor: (s.buffer, s.offset) for s in live.shards if s.rank == 1 and ".layers.2.mlp.experts.6." in s.tensor}
    assert fc1["model.layers.2.mlp.experts.6.gate_proj.weight"] == ("decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight", 0)
    assert fc1["model.layers.2.mlp.experts.6.up_proj.weight"] == ("decoder.layers.2.mlp.experts.local_experts.2.linear_fc1.weight", 32 * 64)
    built = megatron(model_spec({**HF, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32}), dp=2, ep=2)
    assert sum(t.nbytes for t in live.tensors) == sum(t.nbytes for t in built.tensors)
    assert {(b.rank, b.numel) for b in live.buffers if "experts" in b.name} <= {(b.rank, b.numel // 4) for b in built.buffers
                                                                                  if "experts" in b.name}
    with pytest.raises(LayoutError, match="expert-parallel rank 0"):
        from_megatron(_moe_params(1, 2), MOE, padded_vocab_size=256, dp=2, dp_rank=1, ep=2, ep_rank=0)
    for setting, value in (("moe_shared_expert_intermediate_size", 64), ("moe_router_enable_expert_bias", True),
                           ("moe_layer_freq", [1, 0, 1, 0]), ("qk_layernorm", False)):
        with pytest.raises(LayoutError, match=setting if setting != "qk_layernorm" else "Qwen3-MoE kind"):
            from_megatron(_moe_params(0, 2), SimpleNamespace(**{**vars(MOE), setting: value}), padded_vocab_size=256,
                          dp=2, ep=2)
