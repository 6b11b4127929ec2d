"""Layouts: what a trainer or an engine holds, and the plan between them.

Owns the layout model (tensors, their shards on each rank, the buffers that hold them), the builders for the
frameworks' parallelisms (FSDP, ZeRO, Megatron TP/PP/EP, an engine's TP), the model presets, the planner that maps
every destination byte to exactly one source byte, and the views that read a layout's bytes. Pure computation: it
imports nothing else of rlsync but the errors (never ``sync``, ``rollouts`` or ``hooks``).
"""

from __future__ import annotations

from rlsync.core.layouts._layout import Box, BufferSpec, Layout, Shard, TensorMeta, contiguous_strides, dtype_name, dtype_size, make_layout, tensor_fingerprints
from rlsync.core.layouts._dtensors import from_dtensors, from_placements, writer_rank
from rlsync.core.layouts._builders import chunk_bounds, data_parallel, flat_partitions, flat_range_boxes, from_state_dict, fsdp, own_buffer_shard, replicated, tied_aliases, zero3
from rlsync.core.layouts._presets import PRESETS, ModelSpec, Param, load_model_spec, model_spec
from rlsync.core.layouts._planner import Plan, PlanStats, build_plan
from rlsync.core.layouts._transfer import Transfer
from rlsync.core.layouts._views import allocate, copy_transfers, gather_shards, raw_dtype, scatter
from rlsync.core.layouts._parallel import engine_tp, megatron
from rlsync.core.layouts._megatron_model import from_megatron

__all__ = ["Box", "BufferSpec", "Layout", "ModelSpec", "PRESETS", "Param", "Plan", "PlanStats", "Shard", "TensorMeta", "Transfer", "allocate", "build_plan", "chunk_bounds", "contiguous_strides", "copy_transfers", "data_parallel", "dtype_name", "dtype_size", "engine_tp", "flat_partitions", "flat_range_boxes", "from_state_dict", "from_dtensors", "from_megatron", "from_placements", "fsdp", "gather_shards", "load_model_spec", "make_layout", "megatron", "model_spec", "own_buffer_shard", "raw_dtype", "replicated", "scatter", "tensor_fingerprints", "tied_aliases", "writer_rank", "zero3"]
