"""What recording a timeline costs (issue #69): the rollout buffer's hot path (admit, put, get, publish) with the
recorder off and on, per event recorded, and a bare ``event`` call.

    python scripts/timeline_overhead.py              # 20,000 rollouts of one sample, batches of 8
    python scripts/timeline_overhead.py --rollouts 100000

Prints microseconds per rollout off and on, the events the run recorded, and what each cost (the difference over
the events), then the file's size per event.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

import rlsync
from rlsync import timeline


def cycle(rollouts: int, batch: int) -> float:
    """Seconds for ``rollouts`` admit/put of one sample each, a get and a publish every ``batch``."""
    buffer = rlsync.make_buffer("memory", batch_size=batch, max_staleness=1)
    tokens = np.arange(40)
    started = time.perf_counter()
    for i in range(rollouts):
        ticket = buffer.admit(1)
        buffer.put([rlsync.Sample(f"s{i}", tokens, 8, np.zeros(32, np.float32), np.full(32, buffer.version))], ticket)
        if (i + 1) % batch == 0:
            buffer.get(timeout=1)
            buffer.publish(buffer.version + 1)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    cycle(2000, args.batch)  # warm
    off = min(cycle(args.rollouts, args.batch) for _ in range(3))
    with tempfile.TemporaryDirectory() as where:
        ons = []
        for k in range(3):
            path = Path(where) / f"run{k}.jsonl"
            with rlsync.record_timeline(path):
                ons.append(cycle(args.rollouts, args.batch))
            events = sum(1 for _ in open(path, "rb")) - 1  # less the process line
            size = path.stat().st_size
        on = min(ons)
        with rlsync.record_timeline(Path(where) / "bare.jsonl") as recorder:
            started = time.perf_counter()
            for i in range(args.rollouts):
                recorder.event("request", 1.0, 2.0, sequences=4, tokens=100)
            bare = (time.perf_counter() - started) / args.rollouts
    print(f"rollout buffer, {args.rollouts:,} rollouts (batches of {args.batch}): recorder off "
          f"{1e6 * off / args.rollouts:.2f} us a rollout, on {1e6 * on / args.rollouts:.2f} us a rollout")
    print(f"events recorded: {events:,} ({events / args.rollouts:.2f} a rollout), {(on - off) / events * 1e6:.2f} us "
          f"each, {size / events:.0f} bytes each; a bare Recorder.event: {1e6 * bare:.2f} us")


if __name__ == "__main__":
    main()
