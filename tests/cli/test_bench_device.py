"""``rlsync bench --device cpu``: the device harness (the one that runs on a GPU with ``--device cuda``), small, on
the CPU: limits, the bucketed recipe, every landing of the asked transports and a delta version, each checked exact."""

import json
import subprocess
import sys

import pytest


@pytest.mark.multiproc
def test_bench_device_cpu_reports_limits_baseline_paths_and_delta_all_exact() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlsync.cli", "bench", "--device", "cpu", "--size", "16MiB", "--repeats", "1",
         "--transports", "shm,nixl", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["device"] == "cpu" and report["bytes"] > 8 * 2**20 and report["tensors"] > 10
    assert report["limits"]["one_copy_gbps"] > 0 and report["limits"]["per_tensor_gbps"] > 0
    rows = {r["name"]: r for r in report["results"]}
    assert set(rows) == {"bucketed-2GiB", "shm/host", "shm/direct", "nixl/host", "nixl/in_place", "shm/host delta 2%"}
    for row in rows.values():
        assert row["exact"] is True, row  # the engine's parameters equal the trainer's after the last version
        assert row["x_per_tensor_copy"] == pytest.approx(report["limits"]["per_tensor_seconds"] / row["seconds"])
        assert row["x_bucketed"] == pytest.approx(rows["bucketed-2GiB"]["seconds"] / row["seconds"])
    assert rows["shm/host"]["memory"] == "host"
    assert 0 < rows["shm/host delta 2%"]["bytes"] < 0.1 * report["bytes"]  # positions + values of ~2 % of the values
    delta = report["delta"]
    assert delta["changed"] == 0.02 and 0 < delta["delta_bytes"] < 0.1 * delta["full_bytes"]
    assert delta["find_encode_gbps"] > 0 and delta["pays_below_gbps"] > 0


def test_bench_device_cuda_without_a_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--device", "cuda", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no CUDA device here" in out.stderr and "--device cpu" in out.stderr
