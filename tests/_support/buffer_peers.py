"""A rollout generator and a trainer on a Redis buffer, as processes (run on test hosts: ``python buffer_peers.py ...``).

``produce URL N``: puts samples 0..N-1 (``--first F``: F..F+N-1), five at a time, then reports ``{"produced": N, "longest_put": s}``.
``consume URL N``: takes batches until it has N samples, then reports every sample id it got (``{"got": [...]}``).
Each prints ``{"error": ...}`` and exits if the buffer raises (Redis unreachable for longer than ``--retry``).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from rlsync import Sample, make_buffer


def sample(i: int) -> Sample:
    return Sample(f"p{i}", np.arange(40, dtype=np.int32), 8, np.zeros(32, np.float32), np.zeros(32, np.int32),
                  sample_id=f"s{i}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["produce", "consume"])
    parser.add_argument("url")
    parser.add_argument("count", type=int)
    parser.add_argument("--retry", type=float, default=30.0, help="seconds a call keeps retrying an unreachable Redis")
    parser.add_argument("--first", type=int, default=0, help="produce: the first sample's number (ids are never reused)")
    args = parser.parse_args()
    # batches of 5, as the generator puts them: a consumer asked for what was put never waits on a part batch
    buf = make_buffer("redis", url=args.url, retry_seconds=args.retry, batch_size=5, max_staleness=100, on_stale="drop")
    try:
        if args.role == "produce":
            longest = 0.0
            for start in range(0, args.count, 5):
                started = time.monotonic()
                buf.put([sample(args.first + i) for i in range(start, start + 5)])
                longest = max(longest, time.monotonic() - started)
                print(json.dumps({"put": start + 5}), flush=True)
                time.sleep(0.01)
            print(json.dumps({"produced": args.count, "longest_put": longest}), flush=True)
        else:
            got: list[str] = []
            while len(got) < args.count:
                batch = buf.get(timeout=120)
                if batch is None:
                    break
                got += [s.sample_id for s in batch.samples]
            print(json.dumps({"got": got}), flush=True)
    except Exception as exc:  # noqa: BLE001 - what the client sees is what the test checks
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__":
    main()
