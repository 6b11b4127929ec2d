"""LoRA adapter-only sync, trainer side: the PEFT adapter's tensors and configuration, nothing of the base model."""

from __future__ import annotations

import json
from typing import Any


def lora_state(model: Any, adapter: str = "default") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, adapter_config)`` of a PEFT model's LoRA ``adapter``: the A/B matrices under the names a
    PEFT checkpoint gives them (``base_model.model....lora_A.weight``), contiguous, and the adapter's
    configuration as plain JSON data (what ``adapter_config.json`` holds). Send the tensors with a
    ``WeightsWriter``; give the engine the configuration (``rlsync_lora_start``)."""
    try:
        from peft import get_peft_model_state_dict
    except ImportError as exc:
        raise ImportError(f"rlsync.wire.lora_state reads a PEFT adapter: pip install peft ({exc})") from None
    if adapter not in getattr(model, "peft_config", {}):
        raise ValueError(f"the model has no PEFT adapter {adapter!r} (it has {sorted(getattr(model, 'peft_config', {}))})")
    tensors = {name: t.detach().contiguous() for name, t in get_peft_model_state_dict(model, adapter_name=adapter).items()}
    config = json.loads(json.dumps(model.peft_config[adapter].to_dict(), default=sorted))  # sets (target_modules) as lists
    return tensors, config
