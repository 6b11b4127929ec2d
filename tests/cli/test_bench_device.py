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
    assert report["failed"] == [] and "stopped" not in report
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
    zstd = delta["zstd"]  # as a slow link (tcp) sends it: smaller than the planes as they are
    assert 0 < zstd["delta_bytes"] < delta["delta_bytes"] and zstd["find_encode_gbps"] > 0


@pytest.mark.multiproc
def test_bench_device_takes_the_bytes_as_the_tensor_count_asked() -> None:
    """#56's GPU measurement (``--device cuda --tensors 20000``) on the CPU: every path syncs that many tensors, exact."""
    out = subprocess.run(
        [sys.executable, "-m", "rlsync.cli", "bench", "--device", "cpu", "--tensors", "3000", "--size", "8MiB",
         "--repeats", "1", "--transports", "shm", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["tensors"] == 3000 and report["bytes"] == 3000 * 2 * (8 * 2**20 // 2 // 3000)
    assert report["failed"] == [] and {r["name"] for r in report["results"]} == {
        "bucketed-2GiB", "shm/host", "shm/direct", "shm/host delta 2%"}
    assert all(r["exact"] is True for r in report["results"]), report["results"]


def test_bench_device_on_a_presets_tensors_and_its_refusals() -> None:
    from rlsync import ConfigError
    from rlsync.bench._device import _shapes, device_config
    from rlsync.bench._tensors import model_sizes

    shapes = _shapes(device_config(0, model="qwen3-30b-a3b", scale="1/4096"))
    assert dict((name, shape[0]) for name, shape in shapes) == model_sizes("qwen3-30b-a3b", 1 / 4096)
    assert len(shapes) > 18_000  # the experts one by one, as a trainer holds them
    with pytest.raises(ConfigError, match="--tensors 0: from 1 to"):
        device_config(2**20, tensors=0)
    with pytest.raises(ConfigError, match="leave out --tensors"):
        device_config(2**20, tensors=10, model="qwen3-30b-a3b")
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--device", "cpu", "--model", "kimi-k2",
                          "--size", "1GiB"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "leave out --size" in out.stderr


def test_bench_device_cuda_without_a_gpu_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--device", "cuda", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "no CUDA device here" in out.stderr and "--device cpu" in out.stderr


def test_a_path_that_outlasts_its_timeout_is_reported_failed_and_the_rest_still_run() -> None:
    from rlsync.bench._device import measure

    report = measure("cpu", 2**20, ["shm"], repeats=1, path_timeout=0.05)  # no worker starts in 50 ms
    failed = {r["name"]: r["error"] for r in report["failed"]}
    assert set(failed) == {"bucketed-2GiB", "shm/host", "shm/direct", "shm/host delta 2%"}
    assert all("did not finish within 0.05 s (--path-timeout)" in why for why in failed.values()), failed
    assert report["results"] == [] and report["limits"]["one_copy_gbps"] > 0
    assert report["delta"]["find_encode_gbps"] > 0  # measured in this process: it still ran


@pytest.mark.multiproc
def test_a_bench_stopped_by_sigterm_prints_what_it_measured() -> None:
    import signal
    import time

    bench = subprocess.Popen([sys.executable, "-m", "rlsync.cli", "bench", "--device", "cpu", "--size", "64MiB",
                              "--repeats", "3", "--transports", "shm,nixl", "--json"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # stopped once its progress says a path has begun (the copy limits measured), not after a fixed sleep: on a
    # loaded machine 8 s once ended before the bench had imported torch, and it died with nothing to print
    assert bench.stderr is not None
    began, deadline = [], time.monotonic() + 240
    for line in bench.stderr:
        began.append(line)
        if "landing" in line or time.monotonic() > deadline:
            break
    bench.send_signal(signal.SIGTERM)
    out, rest = bench.communicate(timeout=120)
    err = "".join(began) + rest
    report = json.loads(out)
    assert report["stopped"] == "stopped by SIGTERM before every path ran", err
    assert report["limits"]["one_copy_gbps"] > 0
