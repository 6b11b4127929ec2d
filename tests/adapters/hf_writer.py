"""Trainer process for the transformers receiver test: builds the same tiny Qwen2, gives it the
weights of ``--seed`` and pushes them as ``--version`` (run as a script)."""

from __future__ import annotations

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from rlsync.adapters.hf import module_layout
from rlsync.core._weights import WeightsWriter


def tiny_qwen2(seed: int, tied: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    return Qwen2ForCausalLM(config).eval()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--version", type=int, required=True)
    parser.add_argument("--tied", action="store_true")
    args = parser.parse_args()
    model = tiny_qwen2(args.seed, args.tied)
    layout = module_layout(model)
    with WeightsWriter(layout, layout, 0, [args.address], transport="shm") as writer:
        writer.multi_put(dict(model.named_parameters()))
        writer.complete(args.version)
