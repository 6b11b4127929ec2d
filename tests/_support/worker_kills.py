"""Worker processes killed with SIGKILL at random points and started again on the same work (a restarted run), for
the durable-episode tests of the frameworks (tests/frameworks/verl, tests/frameworks/trl)."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def run_with_kills(spawn: Callable[[int], subprocess.Popen[bytes]], workers: int, ready: Path, kills: int, *,
                   seed: int = 11, timeout: float = 600.0) -> int:
    """Start ``spawn(w)`` for every worker w; every 0.3-1 s, while kills are left, SIGKILL a random worker that is at
    work (its pid in ``ready``: its imports are done) and start it again; then wait for every worker to finish its
    work. Returns the kills made; raises if a worker fails on its own."""
    rng = random.Random(seed)
    running = {w: spawn(w) for w in range(workers)}
    killed, deadline = 0, time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in running.values()) and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.3, 1.0))
            failed = {w: p.returncode for w, p in running.items() if p.poll() not in (None, 0)}
            assert not failed, f"workers failed on their own (not killed): {failed}; see their logs"
            started = set(ready.read_text().split()) if ready.exists() else set()
            working = [w for w, p in running.items() if p.poll() is None and str(p.pid) in started]
            if killed < kills and working:  # at work: rollouts mid-turn or mid-call
                victim = rng.choice(working)
                running[victim].send_signal(signal.SIGKILL)
                running[victim].wait()
                killed += 1
                running[victim] = spawn(victim)
        codes = {w: p.wait(timeout=120) for w, p in running.items()}
    finally:
        for p in running.values():
            p.kill()
    assert codes == {w: 0 for w in range(workers)}, f"workers did not finish their work: {codes}"
    return killed
