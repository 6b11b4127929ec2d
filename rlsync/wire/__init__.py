"""Fewer bytes on the wire: fp8 for fp8 engines, deltas between versions, LoRA adapters alone.

Each is off by default and chosen in one place: ``SyncOptions(wire="delta" | "fp8" | "fp8+delta")``
(and ``ModuleReceiver(wire="fp8")`` for a transformers model that loads fp8 weights); a LoRA adapter
alone is sent by giving the writer only ``lora_state(model)`` and the vLLM engine ``rlsync_lora_start``.
"""

from rlsync.wire._fp8 import (
    SCALE_SUFFIX,
    Fp8Codec,
    dequantize,
    fp8_layout,
    fp8_metas,
    fp8_model_spec,
    fp8_round_trip,
    fp8_tensors,
    is_quantized,
    quantize,
    scale_shape,
)
from rlsync.wire._lora import lora_state

__all__ = ["SCALE_SUFFIX", "Fp8Codec", "dequantize", "fp8_layout", "fp8_metas", "fp8_model_spec", "fp8_round_trip", "fp8_tensors", "is_quantized", "lora_state", "quantize", "scale_shape"]
