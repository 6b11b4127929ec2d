"""A live megatron-core model's layout (issue #68), read off the model itself: its config (``TransformerConfig``), its
padded vocabulary, its parameters' names and shapes on this rank, and the parallel sizes and ranks the caller reads
from ``megatron.core.parallel_state`` (``rlsync.adapters.megatron.layout_of`` does). Duck-typed: nothing of megatron
is imported here.

The tensors are the checkpoint's (Hugging Face names, the vocabulary without Megatron's padding); each rank's
buffers are its own parameters under megatron-core's names (``decoder.layers.{i}.self_attention.linear_qkv.weight``
with ``i`` counted within the pipeline stage, as ``named_parameters()`` gives them), so a trainer puts each parameter
as it is. The boxes are ``megatron()``'s (its ``linear_qkv`` groups: each local query group's q heads, then its k and
v head; ``linear_fc1`` as the rank's gate rows then its up rows; row-parallel tensors split on columns), except the
vocabulary's: Megatron splits the padded vocabulary evenly over tensor-parallel ranks, and the rows beyond the
checkpoint's vocabulary are padding, never sent.

Described: dense decoder models of the Llama / Qwen2 / Qwen3 kind (gated MLP, grouped-query attention, RMSNorm),
MoE models of the Qwen3-MoE kind (every layer's MLP routed experts, no shared expert, QK layer norm), megatron-core's
local and Transformer Engine layer specs, tensor, pipeline and expert parallelism with megatron's even split of layers
and experts, data-parallel replicas (each byte then comes from one of them), tied or untied embeddings. Anything else
(shared experts, uneven stages, another MLP) is refused naming the parameter or the setting.

Experts: megatron-core holds each local expert as parameters of its own (``mlp.experts.local_experts.{j}.linear_fc1``
under the local spec's SequentialMLP, ``mlp.experts.linear_fc1.weight{j}`` under Transformer Engine's grouped MLP), the
checkpoint each expert's ``gate_proj`` / ``up_proj`` / ``down_proj``; expert-parallel rank ``e`` of ``ep`` holds experts
``e * E/ep`` to ``(e + 1) * E/ep - 1``, and expert-tensor-parallel ranks split them as tensor parallelism does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from rlsync.core._errors import LayoutError, whole_number
from rlsync.core.layouts._builders import slice_box
from rlsync.core.layouts._layout import Box, BufferSpec, Layout, Shard, TensorMeta, dtype_name, make_layout
from rlsync.core.layouts._parallel import megatron
from rlsync.core.layouts._presets import model_spec

#: rlsync's Megatron buffer names (``megatron()``'s, in layer ``L``) -> megatron-core's parameter names (layer ``l`` of
#: the stage); the second entry: the name under Transformer Engine's layer spec, where it differs
_LAYER_NAMES = {
    "input_layernorm.weight": ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    "self_attention.linear_qkv.weight": ("self_attention.linear_qkv.weight", None),
    "self_attention.linear_qkv.bias": ("self_attention.linear_qkv.bias", None),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", None),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", None),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
    "mlp.linear_fc1.weight": ("mlp.linear_fc1.weight", None),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", None),
    "mlp.gate.weight": ("mlp.router.weight", None),
}
_OTHER_NAMES = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "model.norm.weight": "decoder.final_layernorm.weight",
                "lm_head.weight": "output_layer.weight"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _hf_config(config: Any, vocab_size: int, tied: bool, dtype: str) -> dict[str, Any]:
    """The checkpoint's config (the keys ``model_spec`` reads) from megatron-core's ``TransformerConfig``."""
    if not getattr(config, "gated_linear_unit", False):
        raise LayoutError("rlsync.layouts.from_megatron describes gated MLPs (gated_linear_unit=True: Llama, Qwen); this "
                          "model's linear_fc1 is not gate and up")
    if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
        raise LayoutError(f"rlsync.layouts.from_megatron describes RMSNorm models; this one has {config.normalization}")
    heads = int(config.num_attention_heads)
    qk_norm = bool(getattr(config, "qk_layernorm", False))
    out = {"model_type": "qwen3" if qk_norm else "qwen2" if getattr(config, "add_qkv_bias", False) else "llama",
           "hidden_size": int(config.hidden_size), "num_attention_heads": heads,
           "num_key_value_heads": int(getattr(config, "num_query_groups", None) or heads),
           "head_dim": int(getattr(config, "kv_channels", None) or config.hidden_size // heads),
           "intermediate_size": int(config.ffn_hidden_size), "num_hidden_layers": int(config.num_layers),
           "vocab_size": vocab_size, "tie_word_embeddings": tied, "torch_dtype": dtype,
           "attention_bias": bool(getattr(config, "add_qkv_bias", False))}
    experts = int(getattr(config, "num_moe_experts", None) or 0)
    if experts:
        out.update(_moe_config(config, experts, qk_norm))
    return out


def _moe_config(config: Any, experts: int, qk_norm: bool) -> dict[str, Any]:
    """The checkpoint's MoE keys (Qwen3-MoE's) from megatron-core's MoE settings; what Qwen3-MoE's names cannot hold
    is refused naming the setting."""
    refused = {
        "moe_shared_expert_intermediate_size": "shared experts (Qwen2-MoE, DeepSeek)",
        "moe_router_enable_expert_bias": "a router expert bias (DeepSeek-V3's e_score_correction_bias)",
        "add_bias_linear": "expert biases",
    }
    for setting, what in refused.items():
        if getattr(config, setting, None):
            raise LayoutError(f"rlsync.layouts.from_megatron describes MoE models of the Qwen3-MoE kind; {setting}="
                              f"{getattr(config, setting)!r} ({what}) is not described yet")
    frequency = getattr(config, "moe_layer_freq", 1)
    if frequency != 1 and not (isinstance(frequency, list) and all(f == 1 for f in frequency)):
        raise LayoutError(f"moe_layer_freq={frequency!r}: rlsync.layouts.from_megatron describes MoE models whose every "
                          "layer is MoE (Qwen3-MoE); dense layers between them are not described yet")
    if not qk_norm:
        raise LayoutError("rlsync.layouts.from_megatron describes MoE models of the Qwen3-MoE kind (qk_layernorm=True); "
                          "Mixtral's and Qwen2-MoE's checkpoint names are not described yet")
    return {"model_type": "qwen3_moe", "num_experts": experts, "decoder_sparse_step": 1,
            "moe_intermediate_size": int(getattr(config, "moe_ffn_hidden_size", None) or config.ffn_hidden_size),
            "num_experts_per_tok": int(getattr(config, "moe_router_topk", 2))}


def _expert_shards(shard: Shard, meta: TensorMeta, stage_offset: int, grouped_names: bool) -> list[Shard]:
    """One stacked-expert shard of ``megatron()`` (experts ``e0..e1`` of a layer: its box over ``[E, ...]``, in one
    buffer of the rank's local experts one after another) as megatron-core holds it: each expert in a parameter of its
    own, the checkpoint's tensor of that expert."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight", meta.name)
    if match is None:
        raise LayoutError(f"rlsync has no megatron-core name for the experts of {meta.name!r}")
    layer, kind = int(match.group(1)), match.group(2)
    fc = "linear_fc2" if kind == "down_proj" else "linear_fc1"
    first, count = shard.box.offsets[0], shard.box.sizes[0]
    out = []
    for j in range(count):
        local = f"mlp.experts.{fc}.weight{j}" if grouped_names else f"mlp.experts.local_experts.{j}.{fc}.weight"
        out.append(Shard(f"model.layers.{layer}.mlp.experts.{first + j}.{kind}.weight",
                         Box(shard.box.offsets[1:], shard.box.sizes[1:]), shard.rank,
                         f"decoder.layers.{layer - stage_offset}.{local}", shard.offset, shard.strides[1:]))
    return out


def _per_expert(meta: TensorMeta) -> list[TensorMeta]:
    """A stacked ``[E, ...]`` expert tensor of ``model_spec`` as the checkpoint's tensors, one per expert."""
    head, _, kind = meta.name.rpartition(".experts.")
    return [TensorMeta(f"{head}.experts.{e}.{kind}", meta.dtype, meta.shape[1:]) for e in range(meta.shape[0])]


def _megatron_name(buffer: str, stage_offset: int, engine_names: bool) -> str:
    if buffer in _OTHER_NAMES:
        return _OTHER_NAMES[buffer]
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", buffer)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise LayoutError(f"rlsync has no megatron-core name for {buffer!r}")
    local, te = _LAYER_NAMES[match.group(2)]
    name = te if engine_names and te is not None else local
    return f"decoder.layers.{int(match.group(1)) - stage_offset}.{name}"


def from_megatron(parameters: Mapping[str, Any], config: Any, *, padded_vocab_size: int, vocab_size: int | None = None,
                  tied: bool = False, tp: int = 1, tp_rank: int = 0, pp: int = 1, pp_rank: int = 0, dp: int = 1,
                  dp_rank: int = 0, ep: int = 1, etp: int | None = None, ep_rank: int | None = None,
                  dtype: Any = None) -> Layout:
    """Every rank's layout of a megatron-core ``GPTModel`` (writer rank ``(pp_rank * dp + dp_rank) * tp + tp_rank``:
    megatron's global rank order, tensor-parallel fastest), checked against this rank's ``parameters``
    (``model.named_parameters()``: names and shapes).

    ``padded_vocab_size``: the vocabulary the model was built with (``GPTModel.vocab_size``); ``vocab_size``: the
    checkpoint's (default the same; the rows beyond it are padding); ``tied``: ``share_embeddings_and_output_weights``;
    ``ep`` / ``etp``: expert and expert-tensor parallel sizes of a MoE model (``etp`` default ``tp``), carved out of
    each stage's ``tp * dp`` ranks in megatron's order (expert-tensor fastest); ``ep_rank``: this rank's expert-parallel
    rank as megatron's parallel state says, checked against that order; ``dtype``: what crosses (default the
    parameters')."""
    tp, pp, dp, ep = (whole_number(n, v, 1) for n, v in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)))
    etp = tp if etp is None else whole_number("etp", etp, 1)
    vocab = padded_vocab_size if vocab_size is None else whole_number("vocab_size", vocab_size, 1)
    if padded_vocab_size % tp or vocab > padded_vocab_size:
        raise LayoutError(f"padded_vocab_size={padded_vocab_size} must split over tp={tp} and hold vocab_size={vocab}")
    params = dict(parameters)
    if not params:
        raise LayoutError("from_megatron got no parameters (this rank's model.named_parameters())")
    if ep_rank is not None and ep_rank != ((dp_rank * tp + tp_rank) // etp) % ep:
        raise LayoutError(f"megatron's expert-parallel rank {ep_rank} (tp_rank={tp_rank}, dp_rank={dp_rank}) is not the one "
                          f"of megatron's default order (expert-tensor, then expert, then expert-data parallel, within "
                          f"the tp*dp ranks of a stage): rlsync describes that order only")
    dtype = dtype_name(dtype if dtype is not None else next(iter(params.values())).dtype)
    spec = model_spec(_hf_config(config, vocab, tied, dtype))
    if spec.num_experts and ep * etp > tp * dp:
        raise LayoutError(f"ep*etp ({ep}*{etp}) exceeds the tp*dp ({tp}*{dp}) ranks of a stage: the parallel sizes given "
                          "are not the model's")
    full = megatron(spec, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
    per_stage = spec.num_layers // pp
    if spec.num_layers % pp:
        raise LayoutError(f"{spec.num_layers} layers over pp={pp}: rlsync describes megatron's even split of layers only")
    engine_names = any(name.endswith("layer_norm_weight") for name in params)
    grouped_experts = any(re.search(r"\.experts\.linear_fc1\.weight\d+$", name) for name in params)
    if any(re.search(r"\.experts\.weight[12]$", name) for name in params):
        raise LayoutError("megatron-core's legacy GroupedMLP (experts.weight1/weight2: every local expert in one "
                          "parameter) is not described: use the local spec's SequentialMLP or Transformer Engine's "
                          "grouped MLP (moe_grouped_gemm with TE)")
    rows = padded_vocab_size // tp
    metas = {t.name: t for t in spec.tensors}
    stacked = {p.meta.name for p in spec.params if p.role.startswith("expert_")}
    shards: list[Shard] = []
    sizes: dict[tuple[int, str], tuple[str, int]] = {}
    for shard in full.shards:
        pp_i = shard.rank // (dp * tp)
        if shard.tensor in stacked:
            shards.extend(_expert_shards(shard, metas[shard.tensor], pp_i * per_stage, grouped_experts))
            continue
        buffer = _megatron_name(shard.buffer, pp_i * per_stage, engine_names)
        if shard.tensor in _VOCAB:  # megatron's even split of the padded vocabulary; its padding rows are not sent
            tp_i = shard.rank % tp
            lo, hi = tp_i * rows, min((tp_i + 1) * rows, vocab)
            meta = metas[shard.tensor]
            sizes[(shard.rank, buffer)] = (meta.dtype, rows * meta.shape[1])
            if hi <= lo:
                continue
            shard = Shard(shard.tensor, slice_box(meta.shape, 0, lo, hi), shard.rank, buffer, 0, shard.strides)
        else:
            shard = Shard(shard.tensor, shard.box, shard.rank, buffer, shard.offset, shard.strides)
        shards.append(shard)
    tensors = [t for meta in spec.tensors for t in (_per_expert(meta) if meta.name in stacked else [meta])]
    described = make_layout(tensors, [s for s in shards if s.tensor not in _VOCAB])
    buffers = {(b.rank, b.name): (b.dtype, b.numel) for b in described.buffers}
    buffers.update(sizes)
    layout = make_layout(tensors, shards, [BufferSpec(r, n, dt, k) for (r, n), (dt, k) in sorted(buffers.items())])
    _check_rank(layout, params, (pp_rank * dp + dp_rank) * tp + tp_rank)
    return layout


def _check_rank(layout: Layout, params: Mapping[str, Any], rank: int) -> None:
    """This rank's live parameters are its buffers, name for name and size for size."""
    mine = {b.name: b.numel for b in layout.buffers if b.rank == rank}
    for name, tensor in params.items():
        numel = math.prod(int(n) for n in tensor.shape)
        if name not in mine:
            raise LayoutError(f"megatron-core parameter {name!r} (shape {tuple(tensor.shape)}) is not in rlsync's layout of "
                              f"rank {rank}: a layer, module or layer spec rlsync.layouts.from_megatron does not describe; "
                              f"this rank's buffers are e.g. {sorted(mine)[:4]}")
        if numel != mine[name]:
            raise LayoutError(f"megatron-core parameter {name!r} has shape {tuple(tensor.shape)} ({numel} elements), rlsync's "
                              f"layout of rank {rank} gives it {mine[name]}: its tp/pp sizes or the config do not match the model")
    missing = sorted(set(mine) - set(params))
    if missing:
        raise LayoutError(f"rlsync's layout of rank {rank} has buffers this rank's model does not hold: {missing[:4]} "
                          "(another pipeline stage's layers, or the tp/pp ranks given do not match the model)")
