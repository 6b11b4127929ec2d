"""``rlsync simulate`` against measured runs (issue #69): for each seed of an examples/async_rl.py run recorded with
``--timeline``, the lockstep run's timeline alone predicts the other modes; this prints predicted against measured
samples/s, per mode over the seeds, and the same after the machine's drift between runs is taken out (each run's own
fitted train and sync seconds against its lockstep run's: costs every mode spends alike). The simulator takes the
lengths in the order the lockstep run asked for them (every mode of a seed is given the same tasks in the same order);
``--draw`` draws them at random instead (the mean of 20 runs). A file with several runs (a directory used twice) is
read for its last.

    python examples/async_rl.py --modes lockstep one-step-off async async-partial --steps 20 --seeds 0 1 2 \\
        --out runs/full --timeline runs/full/timeline
    python scripts/simulate_vs_measured.py runs/full [--draw]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from rlsync import timeline


def _last_run_costs(path: Path) -> timeline.Costs:
    run, events = timeline.split_runs(timeline.read_timeline(path))[-1]
    return timeline.fit_costs([run, *events])


def main() -> None:
    out = Path(sys.argv[1])
    replay = "--draw" not in sys.argv[2:]
    runs = json.loads((out / "report.json").read_text())["runs"]
    seeds = sorted({r["seed"] for r in runs})
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    for seed in seeds:
        costs = {m: _last_run_costs(out / "timeline" / f"{m}-seed{seed}.jsonl") for m in modes}
        steps = len(next(r for r in runs if r["seed"] == seed)["steps"])
        predicted = timeline.predict(costs["lockstep"], modes, steps, replay=replay)
        for r in (r for r in runs if r["seed"] == seed):
            c = costs[r["mode"]]
            drift = (c.train_seconds + c.sync_seconds) / (costs["lockstep"].train_seconds + costs["lockstep"].sync_seconds)
            rows[r["mode"]].append((predicted[r["mode"]]["samples_per_second"], r["samples_per_second"], drift))
    print(f"{'mode':>14} {'predicted':>10} {'measured':>9} {'error':>7} {'drift':>6} {'error after drift':>18}   per seed")
    for mode, got in rows.items():
        p, m = statistics.mean(x[0] for x in got), statistics.mean(x[1] for x in got)
        corrected = statistics.mean(x[1] * x[2] for x in got)
        seeds_said = ", ".join(f"{x[0]:.1f}/{x[1]:.1f}" for x in got)
        print(f"{mode:>14} {p:>10.2f} {m:>9.2f} {100 * (p / m - 1):>+6.1f}% {statistics.mean(x[2] for x in got):>6.2f} "
              f"{100 * (p / corrected - 1):>+17.1f}%   {seeds_said}")


if __name__ == "__main__":
    main()
