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
