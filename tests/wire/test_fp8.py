"""fp8 block quantization in the DeepSeek-V3 checkpoint format, and the fp8 engine's tensor list."""

import pytest
import torch

from rlsync.layouts import load_model_spec
from rlsync.wire import dequantize, fp8_model_spec, fp8_tensors, quantize, scale_shape


def test_each_128_block_gets_its_own_scale_and_the_largest_value_maps_to_448() -> None:
    w = torch.zeros(256, 200)
    w[:128, :128] = 0.5
    w[5, 7] = 2.0  # block (0, 0)'s amax
    w[200, 150] = -3.0  # block (1, 1), a partial block (200 columns: 2 blocks)
    q, s = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (2, 2) == scale_shape((256, 200))
    assert s[0, 0] == pytest.approx(2.0 / 448) and s[1, 1] == pytest.approx(3.0 / 448)
    assert s[0, 1] == 1.0 and s[1, 0] == 1.0  # all-zero blocks
    assert q.float()[5, 7] == 448 and q.float()[200, 150] == -448
    assert torch.equal(dequantize(q, s, torch.float32)[5, 7], torch.tensor(2.0))


def test_dequantized_weight_is_close_and_requantizes_to_the_same_bytes() -> None:
    torch.manual_seed(0)
    w = (torch.randn(3, 384, 256) * 0.02).to(torch.bfloat16)  # stacked experts: blocks over the last two dims
    q, s = quantize(w)
    assert s.shape == (3, 3, 2)
    back = dequantize(q, s)
    assert back.dtype == torch.bfloat16
    assert ((back.float() - w.float()).abs() <= w.float().abs() * 0.07 + 1e-4).all()  # e4m3: 3 mantissa bits
    q2, s2 = quantize(back)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


def test_fp8_tensors_follows_the_checkpoint_format() -> None:
    named = {"model.embed_tokens.weight": torch.ones(8, 128), "model.layers.0.mlp.gate.weight": torch.ones(4, 128),
             "model.layers.0.input_layernorm.weight": torch.ones(128), "model.layers.0.mlp.down_proj.weight": torch.ones(128, 256),
             "lm_head.weight": torch.ones(8, 128)}
    out = dict(fp8_tensors(named))
    assert list(out) == [*list(named)[:4], "model.layers.0.mlp.down_proj.weight_scale_inv", "lm_head.weight"]
    assert out["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert all(out[n] is named[n] for n in named if "down_proj" not in n)


def test_fp8_model_spec_adds_fused_scales_next_to_their_weights() -> None:
    spec = fp8_model_spec(load_model_spec("kimi-k2"))
    by_name = {p.meta.name: p for p in spec.params}
    w, s = by_name["model.layers.3.mlp.experts.gate_proj.weight"], by_name["model.layers.3.mlp.experts.gate_proj.weight_scale_inv"]
    assert w.meta.dtype == "float8_e4m3fn" and w.meta.shape == (384, 2048, 7168)
    assert s.meta.dtype == "float32" and s.meta.shape == (384, 16, 56) and s.fused == "model.layers.3.mlp.experts.w13_weight_scale_inv"
    assert s.role == w.role
    assert by_name["model.embed_tokens.weight"].meta.dtype == "bfloat16"
    assert by_name["model.layers.3.mlp.gate.weight"].meta.dtype == "bfloat16"
