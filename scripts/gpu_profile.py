"""Where a trainer's time goes in one weight-sync path: ``rlsync bench --device``'s trainer, under cProfile.

    python3 scripts/gpu_profile.py cuda_ipc direct [4GiB] [0.02]

Runs the bench's engine in a child process (as the bench does) and the trainer here, publishing six versions,
and prints the seconds per version and the functions that took the most time of their own in ``complete`` (the
optional share below 1: delta versions that change it, after two full ones). For the figures
themselves use ``rlsync bench --device cuda``; this says why one of them is what it is.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import json
import pstats
import sys
from typing import Any

from rlsync import WeightsWriter
from rlsync.bench import _device
from rlsync.bench._weights import bench_spec, parse_size


def main() -> None:
    transport, landing = sys.argv[1], sys.argv[2]
    size = parse_size(sys.argv[3] if len(sys.argv) > 3 else "4GiB")
    device = "cuda" if transport in ("cuda_ipc", "nixl") else "cpu"
    out = io.StringIO()
    profile = cProfile.Profile()
    _device.STEP_SECONDS = 0.05  # off the clock: the trainer's sleep between versions would only pad the profile
    changed = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0  # below 1: delta versions changing that share
    complete = WeightsWriter.complete

    def profiled(self: WeightsWriter, *args: Any, **kwargs: Any) -> Any:  # the versions, not the start-up
        profile.enable()
        try:
            return complete(self, *args, **kwargs)
        finally:
            profile.disable()

    WeightsWriter.complete = profiled  # type: ignore[method-assign]
    with contextlib.redirect_stdout(out):
        _device.trainer(device, bench_spec(size), transport, landing, 6, changed)
    seconds = json.loads(out.getvalue().splitlines()[-1])["seconds"]
    print(f"{transport}/{landing}: seconds per version {[round(s * 1e3, 2) for s in seconds]} ms")
    pstats.Stats(profile).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
