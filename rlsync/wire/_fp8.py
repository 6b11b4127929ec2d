"""fp8 on the wire for fp8 engines: the block-quantized checkpoint format of DeepSeek-V3 and
Kimi-K2, which vLLM and SGLang load (``quantization_config = {"quant_method": "fp8",
"weight_block_size": [128, 128]}``).

A quantized weight ``w`` of shape ``[..., out, in]`` travels as ``w`` in ``float8_e4m3fn`` and
``w_scale_inv`` (``name + "_scale_inv"``) in ``float32`` of shape ``[..., ceil(out/128),
ceil(in/128)]``: each 128x128 block is ``q * scale_inv`` with ``scale_inv = amax(|block|) / 448``
(448: the largest finite e4m3 value). Which weights are quantized follows those checkpoints: the
linear layers' 2-D (and stacked-expert 3-D) weights; embeddings, ``lm_head``, the MoE router
(``mlp.gate.weight``), norms and biases stay in the model's dtype.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Final

import msgspec
import torch

from rlsync import LayoutError, WeightMismatchError
from rlsync.layouts import Box, BufferSpec, Layout, ModelSpec, Param, Shard, TensorMeta, contiguous_strides

BLOCK: Final = 128
FP8_MAX: Final = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_SUFFIX: Final = "_scale_inv"
_KEPT: Final = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the fp8 checkpoint format holds tensor ``name`` (of ``shape``) as fp8 + block scales."""
    return name.endswith(".weight") and len(shape) >= 2 and not name.endswith(_KEPT)


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """Shape of the block scales of a weight of ``shape``: the last two dims in blocks."""
    return (*shape[:-2], math.ceil(shape[-2] / block), math.ceil(shape[-1] / block))


def quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 weight, float32 scale_inv)`` of ``weight`` in 128x128 blocks over its last two dims,
    as a DeepSeek-V3 fp8 checkpoint stores it. Computed in float32, on ``weight``'s device."""
    if weight.ndim < 2:
        raise WeightMismatchError(f"fp8 block quantization needs a weight of 2 or more dims, not shape {tuple(weight.shape)}")
    *lead, rows, cols = weight.shape
    pr, pc = -rows % block, -cols % block
    w = torch.nn.functional.pad(weight.float(), (0, pc, 0, pr)) if pr or pc else weight.float()
    blocks = w.reshape(*lead, (rows + pr) // block, block, (cols + pc) // block, block)
    amax = blocks.abs().amax(dim=(-3, -1))
    # a true division on every device: CUDA divides by a Python scalar as a multiplication by its reciprocal, which
    # differs in the last bit from the CPU's quotient (the GPU check found it)
    scale = amax / torch.full_like(amax, FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block: any scale is exact
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, rows + pr, cols + pc)[..., :rows, :cols].contiguous()
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16, block: int = BLOCK) -> torch.Tensor:
    """The weight an fp8 checkpoint loader computes: each block ``q * scale_inv``, in ``dtype``."""
    rows, cols = q.shape[-2:]
    expanded = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :rows, :cols]
    return (q.float() * expanded).to(dtype)


def fp8_round_trip(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """What an engine loads of ``tensor`` sent as fp8 (quantized, then dequantized to its dtype); the tensor itself
    where the format keeps it whole. For a trainer's canary: ``rlsync.Canary.of(model, as_sent=fp8_round_trip)``."""
    if not is_quantized(name, tuple(tensor.shape)):
        return tensor
    return dequantize(*quantize(tensor), tensor.dtype)


def fp8_tensors(named: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors an fp8 engine loads for these model-dtype tensors: each quantized weight as
    ``(name, fp8)`` and ``(name + "_scale_inv", scales)``, every other tensor unchanged.

    Each shard quantizes on its own, so a trainer rank may pass its TP shard only when the shard's
    bounds fall on 128-element block bounds (true of Megatron and engine TP splits of the models
    these checkpoints exist for)."""
    items = named.items() if isinstance(named, Mapping) else named
    for name, tensor in items:
        if is_quantized(name, tuple(tensor.shape)):
            q, scale = quantize(tensor)
            yield name, q
            yield name + SCALE_SUFFIX, scale
        else:
            yield name, tensor


def _fp8_pair(meta: TensorMeta) -> tuple[TensorMeta, TensorMeta]:
    """A quantized weight's two tensors in the fp8 format: the weight in fp8, its block scales in float32."""
    return (TensorMeta(meta.name, "float8_e4m3fn", meta.shape),
            TensorMeta(meta.name + SCALE_SUFFIX, "float32", scale_shape(meta.shape)))


def fp8_model_spec(spec: ModelSpec) -> ModelSpec:
    """The tensor list an fp8 engine holds for ``spec``: quantized weights in ``float8_e4m3fn``,
    each followed by its ``float32`` block scales, sharded and fused the way the weight is (vLLM's
    ``qkv_proj.weight_scale_inv``, ``w13_weight_scale_inv``, ...)."""
    params: list[Param] = []
    for p in spec.params:
        if not is_quantized(p.meta.name, p.meta.shape):
            params.append(p)
            continue
        weight, scale = _fp8_pair(p.meta)
        params.append(msgspec.structs.replace(p, meta=weight))
        params.append(Param(scale, p.role, p.layer, None if p.fused is None else p.fused + SCALE_SUFFIX))
    return msgspec.structs.replace(spec, name=f"{spec.name} (fp8)", params=tuple(params))


def fp8_metas(tensors: Iterable[TensorMeta]) -> list[TensorMeta]:
    """The tensors of the fp8 checkpoint format for these model-dtype tensors (scales after their weights)."""
    return [m for t in tensors for m in (_fp8_pair(t) if is_quantized(t.name, t.shape) else (t,))]


def fp8_layout(layout: Layout) -> Layout:
    """``layout`` with each quantized tensor in fp8 and its block scales sharded alike: a shard's box
    of the scales covers the blocks of its box of the weight, in a buffer of its own (``buffer +
    "_scale_inv"``). Each shard must hold its tensor alone in its buffer, contiguously, with box
    bounds on 128-element block bounds in the last two dims (or at the tensor's end): a rank then
    quantizes its shard on its own and the blocks are the checkpoint's."""
    metas = layout.tensor_map()
    shards: list[Shard] = []
    buffers = {(b.rank, b.name): b for b in layout.buffers}
    new_buffers: dict[tuple[int, str], BufferSpec] = {}
    per_buffer = Counter((s.rank, s.buffer) for s in layout.shards)
    for s in layout.shards:
        meta = metas[s.tensor]
        if not is_quantized(s.tensor, meta.shape):
            shards.append(s)
            continue
        box = s.box
        if s.offset or s.strides != contiguous_strides(box.sizes) or per_buffer[(s.rank, s.buffer)] > 1:
            raise LayoutError(f"fp8 on the wire: tensor {s.tensor!r} on rank {s.rank} shares buffer {s.buffer!r} or is "
                              f"not stored contiguously; quantize before packing, or send bf16 (wire='full')")
        for dim in (-2, -1):
            lo, n, full = box.offsets[dim], box.sizes[dim], meta.shape[dim]
            if lo % BLOCK or (n % BLOCK and lo + n != full):
                raise LayoutError(f"fp8 on the wire: rank {s.rank}'s shard of {s.tensor!r} (offsets {box.offsets}, sizes "
                                  f"{box.sizes}) cuts a {BLOCK}x{BLOCK} block; shard on block bounds or send bf16 (wire='full')")
        blocks = Box((*box.offsets[:-2], box.offsets[-2] // BLOCK, box.offsets[-1] // BLOCK),
                     scale_shape(box.sizes))
        scale_buffer = s.buffer + SCALE_SUFFIX
        shards += [s, Shard(s.tensor + SCALE_SUFFIX, blocks, s.rank, scale_buffer, 0, contiguous_strides(blocks.sizes))]
        spec = buffers[(s.rank, s.buffer)]
        new_buffers[(s.rank, s.buffer)] = BufferSpec(s.rank, s.buffer, "float8_e4m3fn", spec.numel)
        new_buffers[(s.rank, scale_buffer)] = BufferSpec(s.rank, scale_buffer, "float32", math.prod(blocks.sizes))
    out_buffers = [new_buffers.pop(key, b) for key, b in buffers.items()] + list(new_buffers.values())
    return Layout(tuple(fp8_metas(layout.tensors)), tuple(shards), tuple(out_buffers))


class Fp8Codec:
    """The ``"fp8"`` wire codec (``SyncOptions(wire="fp8")``): the writer keeps the trainer's layout as its
    input and sends the fp8 checkpoint format (``fp8_layout``); ``put`` of a model-dtype weight sends its
    quantized blocks and their scales."""

    def __init__(self, src: Layout, rank: int) -> None:
        metas = src.tensor_map()
        # buffer -> the shape of the box it holds, for each quantized weight of this rank
        self.shapes = {s.buffer: s.box.sizes for s in src.shards if s.rank == rank and is_quantized(s.tensor, metas[s.tensor].shape)}
        self.layout = fp8_layout(src)

    def encode(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if name not in self.shapes:
            return None
        if tensor.dtype == torch.float8_e4m3fn:
            raise WeightMismatchError(f"tensor {name!r} is already fp8: with wire='fp8' put the model-dtype weight; "
                                      f"rlsync quantizes it (with its {name + SCALE_SUFFIX!r})")
        if tuple(tensor.shape) != self.shapes[name]:
            raise WeightMismatchError(f"tensor {name!r}: shape {tuple(tensor.shape)}, but its shard is {self.shapes[name]}: "
                                      f"with wire='fp8' put the shard in its shape (its 128x128 blocks are quantized)")
        q, scale = quantize(tensor)
        return {name: q, name + SCALE_SUFFIX: scale}
