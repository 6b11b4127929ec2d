"""``rlsync bench --engine vllm`` runs end to end (tiny model): three paths, the same greedy output after
each, and the weight benchmark's JSON shape."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

pytestmark = [pytest.mark.vllm]


def test_bench_engine_vllm_json() -> None:
    run = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--engine", "vllm", "--engine-model", "tiny",
                          "--json", "--repeats", "1"], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["engine"] == "vllm" and report["greedy_equal"] is True
    assert report["bytes"] == 2 * report["params"] > 0 and report["memcpy_gbps"] > 0
    kinds = {r["name"]: r["kind"] for r in report["results"]}
    assert kinds == {"rlsync-shm": "transport", "rlsync-shm+canary": "transport", "vllm-reload-safetensors-devshm": "baseline",
                     "gloo-broadcast-load_weights": "baseline", "vllm-reload-from-memory": "floor"}
    assert all(r["seconds"] > 0 and r["gbps"] > 0 for r in report["results"])


def test_bench_engine_unknown_model_names_the_choices() -> None:
    run = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--engine", "vllm", "--engine-model", "huge"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 2 and "'125m'" in run.stderr and "'tiny'" in run.stderr
