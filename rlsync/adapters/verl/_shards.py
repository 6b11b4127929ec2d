"""What a verl trainer rank sends on the shard route (issue #67, #68): its own local parameters, described by a layout,
no collective. Two model engines can: verl's FSDP engine (FSDP2 DTensors, exported by its ``get_per_tensor_param_shard``
in bf16 with each parameter's ``ShardSpec``: ``rlsync.layouts.from_placements``) and verl's Megatron engine (one
megatron-core model chunk: its parameters as they are, ``rlsync.adapters.megatron.layout_of``, in the rollout's dtype).
Anything else returns None, with the reason said once in the log, and the gathered route runs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from rlsync.layouts import Layout, dtype_name, from_placements, writer_rank

_log = logging.getLogger("rlsync")


@dataclass
class TrainerShards:
    """Every rank's layout, this rank's writer rank in it, and the buffers it puts (name -> tensor)."""

    layout: Layout
    rank: int
    buffers: dict[str, torch.Tensor]


@functools.cache
def _gathered_because(why: str) -> None:
    _log.info("rlsync: verl's weight sync gathers every tensor on each trainer rank: %s", why)


def trainer_shards(model_engine: Any, rollout_dtype: str) -> TrainerShards | None:
    module = getattr(model_engine, "module", None)
    if isinstance(module, (list, tuple)):  # verl's Megatron engine: its model chunks
        return _megatron(model_engine, list(module), rollout_dtype)
    return _fsdp2(model_engine, rollout_dtype)


def _fsdp2(model_engine: Any, rollout_dtype: str) -> TrainerShards | None:
    """verl's FSDP engine's own export (``get_per_tensor_param_shard()``: ``(name, local flat shard in bf16,
    ShardSpec)``, drained). Not: a LoRA model (its adapter alone, or merged), a rollout that does not serve bf16
    (verl's shards are bf16), a shard its placements do not describe (veomni's expert splits)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    module = getattr(model_engine, "module", None)
    inner = getattr(module, "_fsdp_wrapped_module", module)
    if not isinstance(module, torch.nn.Module) or not any(isinstance(p, DTensor) for p in module.parameters()):
        return _gathered_because(f"verl's {type(model_engine).__name__} holds no FSDP2 module (DTensor parameters)")
    if hasattr(inner, "peft_config"):
        return _gathered_because("a LoRA model: its adapter (or, merged, its merged weights) go as verl exports them")
    if rollout_dtype.removeprefix("torch.") not in ("bfloat16", "bf16"):
        return _gathered_because(f"the rollout serves {rollout_dtype}, and verl exports its local shards in bf16")
    try:
        exported, _ = model_engine.get_per_tensor_param_shard()
    except NotImplementedError:
        return _gathered_because(f"verl's {type(model_engine).__name__} exports no local shards")
    shards = list(exported)  # lazy and local: each a copy of this rank's shard only
    for name, _, spec in shards:
        if spec.place is not None or spec.to_hf_chunk is not None or spec.hf_slots is not None:
            return _gathered_because(f"{name}'s shard is placed by rules its DTensor placements do not describe")
    layout = from_placements({name: (dtype_name(local.dtype), tuple(spec.full_shape), spec.mesh, spec.placements)
                              for name, local, spec in shards})
    me = writer_rank({}, dist.get_rank() if dist.is_initialized() else 0,
                     mesh=next((spec.mesh for _, _, spec in shards if spec.mesh is not None), None))
    boxes = {s.tensor: s.box for s in layout.shards if s.rank == me}
    return TrainerShards(layout, me, {name: local.detach().reshape(boxes[name].sizes) for name, local, _ in shards
                                      if name in boxes})


def _megatron(model_engine: Any, chunks: list[Any], rollout_dtype: str) -> TrainerShards | None:
    """verl's Megatron engine: its one model chunk's parameters as megatron-core holds them (no Megatron-Bridge export,
    no collective), cast to the rollout's dtype. Not: virtual pipeline stages (several chunks), LoRA, a model
    ``layout_of`` does not describe (it says which parameter)."""
    from rlsync import LayoutError

    if len(chunks) != 1:
        return _gathered_because(f"verl's Megatron engine holds {len(chunks)} model chunks (virtual pipeline stages)")
    if getattr(model_engine, "peft_cls", None) is not None:
        return _gathered_because("a LoRA model: its adapter (or, merged, its merged weights) go as verl exports them")
    try:
        from rlsync.adapters.megatron import gpt_model, layout_of, writer_rank as megatron_rank
    except ImportError as exc:
        return _gathered_because(f"megatron-core does not import here ({exc})")
    hf_config = getattr(getattr(model_engine, "model_config", None), "hf_config", None)
    dtype = getattr(torch, rollout_dtype.removeprefix("torch.").replace("bf16", "bfloat16"), torch.bfloat16)
    offloaded = bool(getattr(model_engine, "_is_offload_param", False))
    if offloaded:  # as verl's engine does around its own exports: offloaded parameters come back, then go again
        from verl.utils.megatron_utils import load_megatron_model_to_gpu, offload_megatron_model_to_cpu

        load_megatron_model_to_gpu(chunks, load_grad=False)
    try:
        layout = layout_of(chunks[0], vocab_size=getattr(hf_config, "vocab_size", None), dtype=dtype)
        buffers = {name: p.detach().to(dtype) for name, p in gpt_model(chunks[0]).named_parameters()}
    except LayoutError as exc:
        return _gathered_because(f"rlsync.adapters.megatron.layout_of: {exc}")
    finally:
        if offloaded:
            offload_megatron_model_to_cpu(chunks)
    return TrainerShards(layout, megatron_rank(), buffers)
