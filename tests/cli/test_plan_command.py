"""``rlsync plan`` end to end, as a user runs it."""

import json
import pathlib
import subprocess
import sys

import pytest
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


KIMI = ["plan", "--model", "kimi-k2", "--train", "megatron:tp=8,pp=4,dp=8,ep=8", "--infer", "vllm:tp=16,replicas=8",
        "--nic-gbps", "400", "--json"]


def _report(*extra: str) -> dict:
    result = CliRunner().invoke(app, [*KIMI, *extra])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_fp8_wire_puts_the_1t_moe_at_1_3_seconds() -> None:
    bf16, fp8 = _report("--wire", "bf16"), _report("--wire", "fp8")
    assert fp8["predicted_seconds"] < 1.32 < bf16["predicted_seconds"]  # what the writers do: 1.31 s
    assert fp8["imbalance"] <= 1.05 and fp8["redundancy"] == 1.0
    # fp8 weights + fp32 block scales + the bf16 embedding, head, router and norms: a bit over half
    assert 0.5 < fp8["max_receiver_bytes"] / bf16["max_receiver_bytes"] < 0.51
    # a NodeRelay per node of 8 ranks (half a TP16 replica): every tensor the node holds, whole, into one NIC
    relayed = _report("--wire", "fp8", "--relay-per-node", "8")
    assert relayed["relay_per_node"] == 8 and relayed["receivers"] == 16  # 128 engine ranks, 16 nodes
    assert relayed["max_receiver_bytes"] > 15 * fp8["max_receiver_bytes"] and relayed["predicted_seconds"] > 15


def test_by_default_every_byte_crosses_the_rank_nic_as_the_writers_send_it() -> None:
    report = _report()
    assert report["relay_per_node"] == 0
    assert report["bytes_seconds"] == max(report["max_receiver_bytes"], report["max_sender_bytes"]) * 8 / 400e9
    assert report["predicted_seconds"] == report["bytes_seconds"] + report["host_seconds"]


def test_the_prediction_counts_the_writers_host_time_per_tensor_apart_from_the_bytes() -> None:
    """#56: the busiest writer rank's tensor runs at the measured host cost each, printed beside the bytes' time."""
    measured, slow = _report(), _report("--host-us-per-tensor", "100")
    assert measured["host_us_per_tensor"] == 0.7 and measured["busiest_writer_runs"] > 1000
    assert slow["host_seconds"] == pytest.approx(slow["busiest_writer_runs"] * 100e-6)
    assert slow["predicted_seconds"] == pytest.approx(slow["bytes_seconds"] + slow["host_seconds"])
    table = CliRunner().invoke(app, KIMI[:-1])  # the table, not --json
    assert "predicted: bytes" in table.output and "predicted: host" in table.output, table.output
    assert CliRunner().invoke(app, [*KIMI, "--host-us-per-tensor", "-1"]).exit_code != 0


def test_a_relay_per_node_of_replicas_takes_the_model_once() -> None:
    """Eight one-rank engines on a node: sent to each, the model crosses eight times; through the node's relay,
    once (what ``rlsync.NodeRelay`` lands)."""
    args = ["--model", "qwen2.5-7b", "--train", "fsdp:dp=8", "--infer", "vllm:tp=1,replicas=8", "--nic-gbps", "25"]
    plain = json.loads(CliRunner().invoke(app, ["plan", *args, "--json"]).output)
    relayed = json.loads(CliRunner().invoke(app, ["plan", *args, "--relay-per-node", "8", "--json"]).output)
    assert plain["bytes_sent"] == 8 * plain["model_bytes"] and plain["receivers"] == 8
    assert relayed["bytes_sent"] == relayed["model_bytes"] and relayed["receivers"] == 1
    assert relayed["max_receiver_bytes"] == plain["max_receiver_bytes"]


def test_delta_wire_scales_the_bytes_and_caps_at_a_full_send() -> None:
    full = _report()
    assert _report("--wire", "delta=0.02")["bytes_seconds"] == pytest.approx(full["bytes_seconds"] * 0.02 * 1.33 / 2)
    assert _report("--wire", "delta=0.3")["bytes_seconds"] == pytest.approx(full["bytes_seconds"] * 0.3 * 1.33 / 2)
    assert _report("--wire", "delta=0.5")["bytes_seconds"] == full["bytes_seconds"]  # past the reader's inbox


def test_bad_wire_names_the_choices() -> None:
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "plan", "--wire", "int4"], capture_output=True, text=True)
    assert out.returncode == 2
    assert "--wire 'int4'" in out.stderr and "delta=FRACTION" in out.stderr


def test_a_negative_or_zero_rate_is_a_one_line_error_not_a_negative_prediction() -> None:
    """#58: --nic-gbps -5 predicted -12.19 s."""
    import subprocess
    import sys

    for rate in ("-5", "0"):
        out = subprocess.run([sys.executable, "-m", "rlsync.cli", "plan", "--nic-gbps", rate], capture_output=True, text=True)
        assert out.returncode == 2 and "rlsync: error: ConfigError: --nic-gbps" in out.stderr, out.stderr


def test_a_config_json_without_a_field_it_needs_names_the_field(tmp_path: "pathlib.Path") -> None:
    """#58: a config.json without hidden_size was a 60-line traceback ending in KeyError."""
    import subprocess
    import sys

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2}))
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "plan", "--model", str(config)], capture_output=True, text=True)
    assert out.returncode == 2 and "hidden_size=None" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_hub_id_reads_its_config_through_huggingface_hub_and_says_so_without_it(tmp_path: "pathlib.Path") -> None:
    """#58: `--model Qwen/Qwen2.5-7B-Instruct` was "not a preset". A hub id is read through huggingface_hub (here
    from its cache, offline: this machine has no hub), and named as a hub id where huggingface_hub is missing."""
    from rlsync.layouts import PRESETS

    snapshot = tmp_path / "models--Acme--Tiny-7B" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(PRESETS["qwen2.5-7b"]))
    (tmp_path / "models--Acme--Tiny-7B" / "refs").mkdir()
    (tmp_path / "models--Acme--Tiny-7B" / "refs" / "main").write_text("0123abcd")
    env = {**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    plan = [sys.executable, "-m", "rlsync.cli", "plan", "--model", "Acme/Tiny-7B", "--json"]
    out = subprocess.run(plan, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    preset = json.loads(subprocess.run([*plan[:4], "--model", "qwen2.5-7b", "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    assert report["model"] == "Acme/Tiny-7B" and report["parameters"] == preset["parameters"] > 0

    missing = subprocess.run([sys.executable, "-c", "import sys; sys.modules['huggingface_hub'] = None; "
                              "sys.argv = ['rlsync', 'plan', '--model', 'Acme/Tiny-7B']; import rlsync.cli; rlsync.cli.main()"],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and "looks like a Hugging Face hub id" in missing.stderr, missing.stderr
    assert "pip install huggingface_hub" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    gone = subprocess.run([*plan[:4], "--model", "Acme/Absent"], capture_output=True, text=True, env=env)
    assert gone.returncode == 2 and "could not fetch its config.json" in gone.stderr.splitlines()[-1], gone.stderr


def test_the_table_explains_its_rows() -> None:
    result = CliRunner().invoke(app, ["plan"])
    assert result.exit_code == 0, result.output
    legend = result.output.split("What the rows mean:")[1]
    for row in ("bytes to move", "bytes sent", "redundancy", "transfers", "max per sender", "max per receiver",
                "sender lower bound", "imbalance", "predicted: bytes", "predicted: host"):
        assert row in legend, row


def test_a_tensor_parallel_size_the_engine_refuses_is_refused_with_its_reason() -> None:
    """qwen2.5-7b has 28 attention heads: vLLM and SGLang refuse tp=8 (heads must divide), so the plan does too,
    naming the sizes they take (issue #70); tp=4 plans."""
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "plan", "--model", "qwen2.5-7b", "--train", "fsdp:dp=8",
                          "--infer", "vllm:tp=8"], capture_output=True, text=True)
    assert out.returncode != 0
    assert "28 attention heads" in out.stderr and "tp in [1, 2, 4, 28]" in out.stderr, out.stderr
    assert CliRunner().invoke(app, ["plan", "--model", "qwen2.5-7b", "--train", "fsdp:dp=8", "--infer", "vllm:tp=4"]).exit_code == 0
