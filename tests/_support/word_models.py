"""Tiny chat models built here (no download), for the durable-episode tests of the frameworks: a word-level tokenizer
with a chat template, a tiny Qwen2 with wide random weights (greedy output differs from prompt to prompt), prompts."""

from __future__ import annotations

import random
from pathlib import Path

ROLES = ["<system>", "<user>", "<assistant>", "<tool>", "<end>"]
SPECIAL = ["<pad>", "<eos>", "<unk>"]  # ids 0, 1, 2: pad, eos, unk


def build_tokenizer(where: Path, words: list[str], chat_template: str) -> int:
    """The tokenizer of ``SPECIAL``, ``ROLES`` and ``words``, in that order; its size."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + ROLES + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = chat_template
    fast.save_pretrained(where)
    return len(vocab)


def build_model(where: Path, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(where)


def prompts(n: int, words: list[str], seed: int) -> list[list[dict[str, str]]]:
    """``n`` one-message conversations of 2-5 random words."""
    rng = random.Random(seed)
    return [[{"role": "user", "content": " ".join(rng.choice(words) for _ in range(rng.randrange(2, 6)))}] for _ in range(n)]
