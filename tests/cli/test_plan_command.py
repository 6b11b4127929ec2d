"""``rlsync plan`` end to end, as a user runs it."""

import json
import subprocess
import sys

from typer.testing import CliRunner

from rlsync.cli import app


def test_plan_json_for_the_1t_moe_meets_the_targets() -> None:
    args = ["plan", "--model", "kimi-k2", "--train", "megatron:tp=8,pp=4,dp=8,ep=8",
            "--infer", "vllm:tp=16,replicas=8", "--nic-gbps", "400", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["redundancy"] == 1.0
    assert report["imbalance"] <= 1.05
    assert report["predicted_seconds"] > 0
    assert {"build_seconds", "redundancy", "imbalance", "predicted_seconds"} <= report.keys()


def test_plan_table_and_one_rank() -> None:
    result = CliRunner().invoke(app, ["plan", "--model", "qwen2.5-7b", "--train", "zero3:dp=8", "--infer", "vllm:tp=4,replicas=2", "--rank", "3"])
    assert result.exit_code == 0, result.output
    for row in ("bytes to move", "transfers", "max per sender", "predicted transfer"):
        assert row in result.output


def test_bad_spec_is_one_clear_line_and_exit_2() -> None:
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "plan", "--train", "megatron:tp=x"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "bad item 'tp=x'" in out.stderr and "Traceback" not in out.stderr
