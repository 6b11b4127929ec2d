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
megatron-core's local and Transformer Engine layer specs, tensor and pipeline parallelism with megatron's even split
of layers, data-parallel replicas (each byte then comes from one of them), tied or untied embeddings. Anything else
(MoE layers, uneven stages, another MLP) is refused naming the parameter or the setting.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from rlsync.core._errors import LayoutError, whole_number
from rlsync.core.layouts._builders import slice_box
from rlsync.core.layouts._layout import BufferSpec, Layout, Shard, dtype_name, make_layout
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
}
_OTHER_NAMES = {"model.embed_tokens.weight": "embedding.word_embeddings.weight", "model.norm.weight": "decoder.final_layernorm.weight",
                "lm_head.weight": "output_layer.weight"}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _hf_config(config: Any, vocab_size: int, tied: bool, dtype: str) -> dict[str, Any]:
    """The checkpoint's config (the keys ``model_spec`` reads) from megatron-core's ``TransformerConfig``."""
    if getattr(config, "num_moe_experts", None):
        raise LayoutError("rlsync.layouts.from_megatron does not describe megatron-core's MoE layers yet "
                          f"(num_moe_experts={config.num_moe_experts}): use rlsync.layouts.megatron(spec, tp, pp, ep)")
    if not getattr(config, "gated_linear_unit", False):
        raise LayoutError("rlsync.layouts.from_megatron describes gated MLPs (gated_linear_unit=True: Llama, Qwen); this "
                          "model's linear_fc1 is not gate and up")
    if getattr(config, "normalization", "RMSNorm") != "RMSNorm":
        raise LayoutError(f"rlsync.layouts.from_megatron describes RMSNorm models; this one has {config.normalization}")
    heads = int(config.num_attention_heads)
    qk_norm = bool(getattr(config, "qk_layernorm", False))
    return {"model_type": "qwen3" if qk_norm else "qwen2" if getattr(config, "add_qkv_bias", False) else "llama",
            "hidden_size": int(config.hidden_size), "num_attention_heads": heads,
            "num_key_value_heads": int(getattr(config, "num_query_groups", None) or heads),
            "head_dim": int(getattr(config, "kv_channels", None) or config.hidden_size // heads),
            "intermediate_size": int(config.ffn_hidden_size), "num_hidden_layers": int(config.num_layers),
            "vocab_size": vocab_size, "tie_word_embeddings": tied, "torch_dtype": dtype,
            "attention_bias": bool(getattr(config, "add_qkv_bias", False))}


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
                  dp_rank: int = 0, dtype: Any = None) -> Layout:
    """Every rank's layout of a megatron-core ``GPTModel`` (writer rank ``(pp_rank * dp + dp_rank) * tp + tp_rank``:
    megatron's global rank order, tensor-parallel fastest), checked against this rank's ``parameters``
    (``model.named_parameters()``: names and shapes).

    ``padded_vocab_size``: the vocabulary the model was built with (``GPTModel.vocab_size``); ``vocab_size``: the
    checkpoint's (default the same; the rows beyond it are padding); ``tied``: ``share_embeddings_and_output_weights``;
    ``dtype``: what crosses (default the parameters')."""
    tp, pp, dp = (whole_number(n, v, 1) for n, v in (("tp", tp), ("pp", pp), ("dp", dp)))
    vocab = padded_vocab_size if vocab_size is None else whole_number("vocab_size", vocab_size, 1)
    if padded_vocab_size % tp or vocab > padded_vocab_size:
        raise LayoutError(f"padded_vocab_size={padded_vocab_size} must split over tp={tp} and hold vocab_size={vocab}")
    params = dict(parameters)
    if not params:
        raise LayoutError("from_megatron got no parameters (this rank's model.named_parameters())")
    dtype = dtype_name(dtype if dtype is not None else next(iter(params.values())).dtype)
    spec = model_spec(_hf_config(config, vocab, tied, dtype))
    full = megatron(spec, tp=tp, pp=pp, dp=dp)
    per_stage = spec.num_layers // pp
    if spec.num_layers % pp:
        raise LayoutError(f"{spec.num_layers} layers over pp={pp}: rlsync describes megatron's even split of layers only")
    engine_names = any(name.endswith("layer_norm_weight") for name in params)
    rows = padded_vocab_size // tp
    metas = {t.name: t for t in spec.tensors}
    shards: list[Shard] = []
    sizes: dict[tuple[int, str], tuple[str, int]] = {}
    for shard in full.shards:
        pp_i = shard.rank // (dp * tp)
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
    described = make_layout(spec.tensors, [s for s in shards if s.tensor not in _VOCAB])
    buffers = {(b.rank, b.name): (b.dtype, b.numel) for b in described.buffers}
    buffers.update(sizes)
    layout = make_layout(spec.tensors, shards, [BufferSpec(r, n, dt, k) for (r, n), (dt, k) in sorted(buffers.items())])
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
