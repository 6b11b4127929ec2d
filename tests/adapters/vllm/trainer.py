"""Trainer process for the vLLM tests: pushes the weights of tiny models, one version per seed."""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlsync.adapters.hf import module_layout
from rlsync.core._weights import WeightsWriter

CONFIGS = {
    "qwen2": dict(model_type="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False),
    "qwen2-tied": dict(model_type="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True),
    "llama": dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False),
}


def build(arch: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = dict(CONFIGS[arch])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for p in model.parameters():  # larger weights than the default init: greedy output then depends on them
            p.normal_(0, 0.2)
    return model


def tensors(model: torch.nn.Module) -> list[list[object]]:
    return [[n, str(p.dtype), list(p.shape)] for n, p in model.named_parameters()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--first-version", type=int, default=1)
    args = parser.parse_args()
    writer = None
    for i, seed in enumerate(args.seeds):
        model = build(args.arch, seed)
        if writer is None:
            layout = module_layout(model)
            writer = WeightsWriter(layout, layout, 0, [args.address], timeout=600)
        writer.multi_put(dict(model.named_parameters()))
        writer.complete(args.first_version + i)
        print(json.dumps({"completed": args.first_version + i}), flush=True)
