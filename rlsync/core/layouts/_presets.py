"""Model presets: the full list of a model's tensors, with the role each plays, from a
transformers ``config.json``-style dict.

Roles tell the layout builders how trainers and engines split and fuse a tensor (column- or
row-parallel, part of a fused qkv, a stacked expert projection, ...). MoE experts are one
stacked ``[E, out, in]`` tensor per projection and layer, the way grouped-GEMM trainers and
inference engines hold them; an HF checkpoint's per-expert tensors are slices of it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, final

import msgspec

from rlsync.core._errors import LayoutError
from rlsync.core.layouts._layout import TensorMeta

#: Roles and how they are split across tensor-parallel ranks.
#:   replicated      every rank holds all of it (norms, routers, small projections)
#:   vocab           split along dim 0 (embedding, lm_head)
#:   column          split along dim 0 (output features)
#:   row             split along dim 1 (input features)
#:   q, k, v         attention projections (and their biases), fused into qkv by engines
#:   gate, up        MLP input projections, fused into gate_up by engines
#:   down            MLP output projection (row)
#:   expert_gate, expert_up, expert_down: stacked experts [E, I, H] / [E, H, I]
#:   mla_q_a, mla_kv_a: MLA down projections, fused (replicated) by engines
ROLES: Final = frozenset(
    {"replicated", "vocab", "column", "row", "q", "k", "v", "gate", "up", "down",
     "expert_gate", "expert_up", "expert_down", "mla_q_a", "mla_kv_a"}
)


@final
class Param(msgspec.Struct, frozen=True):
    """One global tensor of a model and the role that decides how it is sharded."""

    meta: TensorMeta
    role: str
    layer: int | None = None  # None: outside the decoder layers (embedding, final norm, head)
    #: the fused engine parameter it belongs to (``...qkv_proj.weight``), if any
    fused: str | None = None


@final
class ModelSpec(msgspec.Struct, frozen=True):
    name: str
    params: tuple[Param, ...]
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        return tuple(p.meta for p in self.params)

    @property
    def nbytes(self) -> int:
        return sum(p.meta.nbytes for p in self.params)

    @property
    def numel(self) -> int:
        return sum(p.meta.numel for p in self.params)


def _dtype(config: Mapping[str, Any]) -> str:
    return str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")


@dataclasses.dataclass(frozen=True)
class _Dims:
    """The sizes a decoder's tensor list is built from, read from its HF config."""

    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    mla: bool
    experts: int
    moe_inter: int
    shared: int
    first_dense: int
    sparse_step: int
    qkv_bias: bool
    qk_norm: bool


_Add = Callable[..., None]


_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size")


def model_spec(config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
    """Build the tensor list of a decoder-only model from its HF config dict.

    Supported: Qwen2/2.5/3, Llama, Mistral (dense); Qwen2-MoE/Qwen3-MoE, Mixtral (MoE);
    DeepSeek-V2/V3 and Kimi-K2 (MLA attention, first_k_dense_replace dense layers, shared experts).
    A field it needs that is missing or not a positive number is a ``LayoutError`` naming it.
    """
    for key in _REQUIRED:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LayoutError(f"the model config has {key}={value!r}: rlsync builds a decoder-only LLM's tensor list from "
                              f"its config.json, which needs {', '.join(_REQUIRED)} (positive integers)")
    try:
        return _model_spec(config, name)
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"the model config cannot be read as a decoder-only LLM's ({type(exc).__name__}: {exc}): "
                          f"see the supported families in rlsync.layouts.model_spec") from None


def _model_spec(config: Mapping[str, Any], name: str | None) -> ModelSpec:
    arch = str(config.get("model_type", ""))
    dt = _dtype(config)
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    inter = int(config["intermediate_size"])
    d = _Dims(
        arch=arch, hidden=hidden, heads=heads, kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads), inter=inter,
        mla="kv_lora_rank" in config and config.get("kv_lora_rank") is not None,
        experts=int(config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0),
        moe_inter=int(config.get("moe_intermediate_size") or inter), shared=int(config.get("n_shared_experts") or 0),
        first_dense=int(config.get("first_k_dense_replace") or 0), sparse_step=int(config.get("decoder_sparse_step") or 1),
        qkv_bias=arch in ("qwen2", "qwen2_moe") or bool(config.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"))
    layers, vocab = int(config["num_hidden_layers"]), int(config["vocab_size"])
    params: list[Param] = []

    def add(pname: str, shape: tuple[int, ...], role: str, layer: int | None = None, fused: str | None = None) -> None:
        params.append(Param(TensorMeta(pname, dt, shape), role, layer, fused))

    add("model.embed_tokens.weight", (vocab, hidden), "vocab")
    for i in range(layers):
        p = f"model.layers.{i}"
        add(f"{p}.input_layernorm.weight", (hidden,), "replicated", i)
        if d.mla:
            _mla_attention(add, config, d, p, i)
        else:
            _attention(add, d, p, i)
        add(f"{p}.post_attention_layernorm.weight", (hidden,), "replicated", i)
        if d.experts > 0 and i >= d.first_dense and (i + 1) % d.sparse_step == 0:
            _moe_mlp(add, d, f"{p}.mlp", i)
        else:
            _dense_mlp(add, d, f"{p}.mlp", i)
    add("model.norm.weight", (hidden,), "replicated")
    if not bool(config.get("tie_word_embeddings", False)):
        add("lm_head.weight", (vocab, hidden), "vocab")
    return ModelSpec(name or arch or "model", tuple(params), layers, heads, d.kv_heads if not d.mla else heads,
                     d.head_dim, d.experts)


def _mla_attention(add: _Add, config: Mapping[str, Any], d: _Dims, p: str, i: int) -> None:
    q_lora = config.get("q_lora_rank")
    kv_lora = int(config["kv_lora_rank"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    v_dim = int(config["v_head_dim"])
    fused_a = f"{p}.self_attn.fused_qkv_a_proj.weight"
    if q_lora:
        add(f"{p}.self_attn.q_a_proj.weight", (int(q_lora), d.hidden), "mla_q_a", i, fused_a)
        add(f"{p}.self_attn.q_a_layernorm.weight", (int(q_lora),), "replicated", i)
        add(f"{p}.self_attn.q_b_proj.weight", (d.heads * (nope + rope), int(q_lora)), "column", i)
    else:
        add(f"{p}.self_attn.q_proj.weight", (d.heads * (nope + rope), d.hidden), "column", i)
    add(f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, d.hidden), "mla_kv_a", i, fused_a)
    add(f"{p}.self_attn.kv_a_layernorm.weight", (kv_lora,), "replicated", i)
    add(f"{p}.self_attn.kv_b_proj.weight", (d.heads * (nope + v_dim), kv_lora), "column", i)
    add(f"{p}.self_attn.o_proj.weight", (d.hidden, d.heads * v_dim), "row", i)


def _attention(add: _Add, d: _Dims, p: str, i: int) -> None:
    qkv = f"{p}.self_attn.qkv_proj.weight"
    add(f"{p}.self_attn.q_proj.weight", (d.heads * d.head_dim, d.hidden), "q", i, qkv)
    add(f"{p}.self_attn.k_proj.weight", (d.kv_heads * d.head_dim, d.hidden), "k", i, qkv)
    add(f"{p}.self_attn.v_proj.weight", (d.kv_heads * d.head_dim, d.hidden), "v", i, qkv)
    if d.qkv_bias:
        qkvb = f"{p}.self_attn.qkv_proj.bias"
        add(f"{p}.self_attn.q_proj.bias", (d.heads * d.head_dim,), "q", i, qkvb)
        add(f"{p}.self_attn.k_proj.bias", (d.kv_heads * d.head_dim,), "k", i, qkvb)
        add(f"{p}.self_attn.v_proj.bias", (d.kv_heads * d.head_dim,), "v", i, qkvb)
    if d.qk_norm:
        add(f"{p}.self_attn.q_norm.weight", (d.head_dim,), "replicated", i)
        add(f"{p}.self_attn.k_norm.weight", (d.head_dim,), "replicated", i)
    add(f"{p}.self_attn.o_proj.weight", (d.hidden, d.heads * d.head_dim), "row", i)


def _moe_mlp(add: _Add, d: _Dims, m: str, i: int) -> None:
    add(f"{m}.gate.weight", (d.experts, d.hidden), "replicated", i)
    if d.arch in ("deepseek_v3", "kimi_k2"):
        add(f"{m}.gate.e_score_correction_bias", (d.experts,), "replicated", i)
    add(f"{m}.experts.gate_proj.weight", (d.experts, d.moe_inter, d.hidden), "expert_gate", i, f"{m}.experts.w13_weight")
    add(f"{m}.experts.up_proj.weight", (d.experts, d.moe_inter, d.hidden), "expert_up", i, f"{m}.experts.w13_weight")
    add(f"{m}.experts.down_proj.weight", (d.experts, d.hidden, d.moe_inter), "expert_down", i, f"{m}.experts.w2_weight")
    if d.shared:
        s_inter = d.moe_inter * d.shared
        s = f"{m}.shared_experts"
        add(f"{s}.gate_proj.weight", (s_inter, d.hidden), "gate", i, f"{s}.gate_up_proj.weight")
        add(f"{s}.up_proj.weight", (s_inter, d.hidden), "up", i, f"{s}.gate_up_proj.weight")
        add(f"{s}.down_proj.weight", (d.hidden, s_inter), "down", i)


def _dense_mlp(add: _Add, d: _Dims, m: str, i: int) -> None:
    add(f"{m}.gate_proj.weight", (d.inter, d.hidden), "gate", i, f"{m}.gate_up_proj.weight")
    add(f"{m}.up_proj.weight", (d.inter, d.hidden), "up", i, f"{m}.gate_up_proj.weight")
    add(f"{m}.down_proj.weight", (d.hidden, d.inter), "down", i)


#: config.json excerpts of real models (only the fields the tensor list depends on).
PRESETS: Final[dict[str, dict[str, Any]]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": dict(model_type="qwen2", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=29568, vocab_size=152064, tie_word_embeddings=False),
    "llama3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama3-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, vocab_size=151936, tie_word_embeddings=False),
    "kimi-k2": dict(model_type="kimi_k2", hidden_size=7168, num_hidden_layers=61, num_attention_heads=64,
                    num_key_value_heads=64, intermediate_size=18432, moe_intermediate_size=2048,
                    first_k_dense_replace=1, n_routed_experts=384, n_shared_experts=1, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    vocab_size=163840, tie_word_embeddings=False),
}


def load_model_spec(model: str) -> ModelSpec:
    """A preset by name, or a ``config.json`` path."""
    if model in PRESETS:
        return model_spec(PRESETS[model], model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return model_spec(json.loads(path.read_text()), path.parent.name or model)
    raise LayoutError(f"unknown model {model!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a config.json path")
