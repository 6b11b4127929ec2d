"""``rlsync bench --tensors N`` and ``--model PRESET --scale F``: the host cost per tensor, on equal tensors or on a
preset's own tensor list (experts one by one, as a trainer holds them), every version bit-exact."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rlsync.bench._tensors import model_sizes
from rlsync.cli import app
from rlsync.layouts import load_model_spec

pytestmark = pytest.mark.multiproc


def test_a_presets_tensors_are_the_trainers_experts_one_by_one() -> None:
    spec = load_model_spec("qwen3-30b-a3b")  # 48 MoE layers of 128 experts, gate/up/down stacked per layer
    sizes = model_sizes("qwen3-30b-a3b", 1.0)
    stacked = [p for p in spec.params if p.role.startswith("expert_")]
    assert len(stacked) == 48 * 3 and len(sizes) == len(spec.params) - len(stacked) + 48 * 128 * 3  # about 19,000
    assert sum(sizes.values()) == spec.numel  # the same values, split
    gate = stacked[0].meta
    assert sizes[f"{gate.name}.127"] == gate.shape[1] * gate.shape[2]
    scaled = model_sizes("qwen3-30b-a3b", 1 / 256)
    assert scaled.keys() == sizes.keys() and min(scaled.values()) >= 1
    assert sum(scaled.values()) == pytest.approx(spec.numel / 256, rel=0.01)


@pytest.mark.parametrize("args", [["--tensors", "300", "--size", "2MiB"], ["--model", "qwen2.5-0.5b", "--scale", "1/2048"]],
                         ids=["equal tensors", "a preset's tensors"])
def test_the_bench_reports_each_sides_host_cost_per_tensor_and_every_version_exact(args: list[str]) -> None:
    result = CliRunner().invoke(app, ["bench", *args, "--repeats", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output.strip().splitlines()[-1])
    assert report["tensors"] == (300 if "--tensors" in args else len(load_model_spec("qwen2.5-0.5b").params))
    assert report["bit_exact"] and report["versions"] == 3 and report["memcpy_gbps"] > 0
    for side in ("writer", "reader"):
        assert isinstance(report[f"{side}_us_per_tensor"], float)
        assert len(report["many_tensors"][f"{side}_seconds"]) == 3


def test_a_preset_with_tensors_or_size_or_a_bad_scale_is_refused() -> None:
    for args, named in ((["--model", "qwen2.5-0.5b", "--tensors", "10"], "leave out"), (["--model", "gpt5"], "gpt5"),
                        (["--model", "qwen2.5-0.5b", "--scale", "2"], "--scale"),
                        (["--model", "qwen2.5-0.5b", "--scale", "1/0"], "--scale"),
                        (["--model", "kimi-k2", "--scale", "1"], "smaller --scale")):
        result = CliRunner().invoke(app, ["bench", *args])
        assert result.exit_code != 0 and named in str(result.exception), (args, result.exception)
