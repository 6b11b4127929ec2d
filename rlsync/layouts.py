"""Layout builders and model presets, in one public place.

    from rlsync.layouts import fsdp, megatron, engine_tp, load_model_spec
    spec = load_model_spec("qwen2.5-7b")
    plan = rlsync.build_plan(fsdp(spec.tensors, 8), engine_tp(spec, tp=4, replicas=2))
"""

from rlsync.core._builders import data_parallel, flat_partitions, from_state_dict, fsdp, replicated, zero3
from rlsync.core._layout_parallel import engine_tp, megatron
from rlsync.core._presets import PRESETS, ModelSpec, Param, load_model_spec, model_spec

__all__ = [
    "PRESETS",
    "ModelSpec",
    "Param",
    "data_parallel",
    "flat_partitions",
    "engine_tp",
    "from_state_dict",
    "fsdp",
    "load_model_spec",
    "megatron",
    "model_spec",
    "replicated",
    "zero3",
]
