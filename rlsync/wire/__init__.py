"""Fewer bytes on the wire: fp8 for fp8 engines, deltas between versions, LoRA adapters alone.

Each is off by default and chosen in one place (see the README's "Fewer bytes" section).
"""

from rlsync.wire._fp8 import dequantize, fp8_tensors, is_quantized, quantize, scale_shape

__all__ = ["dequantize", "fp8_tensors", "is_quantized", "quantize", "scale_shape"]
