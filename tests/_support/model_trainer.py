"""Trainer process for the vLLM tests: pushes the weights of tiny models, one version per seed."""

from __future__ import annotations

import argparse
import copy
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion

from rlsync import Canary, CanaryError, PeerLostError, SyncOptions, WeightsWriter, version_label
from rlsync.layouts import from_state_dict

CONFIGS = {
    "qwen2": dict(model_type="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False),
    "qwen2-tied": dict(model_type="qwen2", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=True),
    "llama": dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, tie_word_embeddings=False),
    "qwen3-moe": dict(model_type="qwen3_moe", vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                      tie_word_embeddings=False),
    "qwen3-tied": dict(model_type="qwen3", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                       tie_word_embeddings=True),
    # tied, and vLLM's Gemma2 model has no lm_head at all (logits from embed_tokens); Gemma3's ties one
    "gemma2-tied": dict(model_type="gemma2", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                        tie_word_embeddings=True),
    "gemma3-tied": dict(model_type="gemma3_text", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=128,
                        tie_word_embeddings=True),
}


def build(arch: str, seed: int, head_std: float = 0.2) -> torch.nn.Module:
    """A tiny model of ``arch`` with the weights of ``seed``; ``head_std`` 1.0 peaks its next-token distribution as in
    a trained LM (the canary tests: a random init predicts nearly uniform tokens, which any weights reproduce)."""
    torch.manual_seed(seed)
    cfg = dict(CONFIGS[arch])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # larger weights than the default init: greedy output then depends on them
            p.normal_(0, head_std if name == "lm_head.weight" else 0.2)
        if config.model_type.startswith("gemma"):  # Gemma scales embeddings by sqrt(hidden) and norms what each layer
            model.get_input_embeddings().weight.mul_(0.1)  # adds: else the token's own embedding decides the output
    return model


def checkpoint_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights under their checkpoint names, as a trainer exports them (transformers 5 fuses MoE experts
    in memory, e.g. ``experts.gate_up_proj``; checkpoints and vLLM's loader use ``experts.N.gate_proj.weight``)."""
    state = revert_weight_conversion(model, dict(model.named_parameters()))
    return {name: t.detach().contiguous() for name, t in state.items()}


def tensors(model: torch.nn.Module, state_dict: bool = False) -> list[list[object]]:
    """The tensor list a trainer offers: its checkpoint's, or its ``state_dict()``'s (a tied alias included)."""
    state = model.state_dict() if state_dict else checkpoint_state(model)
    return [[n, str(t.dtype), list(t.shape)] for n, t in state.items()]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--arch", required=True)
    parser.add_argument("--address", required=True, nargs="+", help="one per engine worker, in rank order")
    parser.add_argument("--alias", action="store_true", help="send a tied model's lm_head.weight too, as state_dict() has it")
    parser.add_argument("--state-dict", action="store_true", help="send model.state_dict() as it is (tied aliases in it)")
    parser.add_argument("--canary", action="store_true", help="send each version's canary (an fp32 trainer's), and go "
                                                                 "on with the next version when an engine refuses one")
    parser.add_argument("--head-std", type=float, default=0.2, help="build(..., head_std=)")
    parser.add_argument("--verify", action="store_true", help="send a checksum per tensor (SyncOptions(verify=True))")
    parser.add_argument("--seeds", type=int, nargs="+", required=True)
    parser.add_argument("--first-version", type=int, default=1)
    args = parser.parse_args()
    writer = None
    for i, seed in enumerate(args.seeds):
        model = build(args.arch, seed, args.head_std)
        state = dict(model.state_dict()) if args.state_dict else checkpoint_state(model)
        if args.alias:
            state["lm_head.weight"] = model.get_output_embeddings().weight.detach()
        if writer is None:  # the destination layout comes from the engine's workers
            writer = WeightsWriter(from_state_dict(state), None, 0, args.address, options=SyncOptions(timeout=600, verify=args.verify))
        writer.multi_put(state)
        version = args.first_version + i
        if not args.canary:
            writer.complete(version)
            print(json.dumps({"completed": version}), flush=True)
            continue
        try:
            writer.complete(version, canary=Canary.of(copy.deepcopy(model).float()))  # fp32 master weights of these bf16 ones
            label = version_label(version, [writer.last_digests[r] for r in sorted(writer.last_digests)])
            print(json.dumps({"completed": version, "canary_deviation": writer.last_canary_deviation, "label": label}), flush=True)
        except (CanaryError, PeerLostError) as exc:  # refused by the canary, or by the engine's load (checked bytes)
            print(json.dumps({"refused": version, "error": str(exc)}), flush=True)
