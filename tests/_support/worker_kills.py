"""Worker processes killed with SIGKILL at random points and started again on the same work (a restarted run), and
what their call logs must show, for the durable-episode tests of the frameworks (tests/frameworks/verl and trl)."""

from __future__ import annotations

import collections
import multiprocessing
import os
import random
import re
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_with_kills(spawn: Callable[[int], Any], workers: int, ready: Path, kills: int, *,
                   seed: int = 11, timeout: float = 600.0, every: tuple[float, float] = (0.3, 1.0)) -> int:
    """Start ``spawn(w)`` for every worker w; every ``every`` seconds (at random between the two), while kills are
    left, SIGKILL a random worker that is at work (its pid in ``ready``: its imports are done) and start it again;
    then wait for every worker to finish its work. Returns the kills made; raises if a worker fails on its own."""
    rng = random.Random(seed)
    running = {w: spawn(w) for w in range(workers)}
    killed, deadline = 0, time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in running.values()) and time.monotonic() < deadline:
            time.sleep(rng.uniform(*every))
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


def check_calls(tools: Path, reference: Path, *, most_run_again: int) -> tuple[set[str], list[str]]:
    """The tool and model calls of a run with kills, as its workers logged them (``tools``, ``<tools>.model-calls``):
    no tool call ran after its result was recorded, every call of the run without a kill (``reference``) ran and no
    other, at most ``most_run_again`` ran again (calls in flight at a kill), and no recorded model turn was generated
    again. Returns the reference's tool calls and the run's model calls."""
    lines = tools.read_text().splitlines()
    assert not [line for line in lines if "AFTER" in line], "a tool call ran after its result was recorded"
    executions = collections.Counter(lines)
    reference_calls = set(reference.read_text().splitlines())
    assert set(executions) == reference_calls, "every tool call of the run ran, and no other"
    again = sum(n - 1 for n in executions.values())
    assert again <= most_run_again, f"{again} tool calls ran again (at most {most_run_again} were in flight at kills)"
    calls = Path(f"{tools}.model-calls").read_text().splitlines()
    assert not [c for c in calls if c.startswith("FOR-A-RECORDED-TURN")], "a recorded model turn was generated again"
    return reference_calls, calls


def check_rerun(tools: Path, executed: str, called: str, rerun_log: Path, replays: int) -> None:
    """A re-run after everything finished (its log ``rerun_log``) called no tool and no model (the call logs are still
    ``executed`` and ``called``) and replayed ``replays`` finished episodes whole."""
    assert tools.read_text() == executed, "a re-run of finished episodes called a tool"
    assert Path(f"{tools}.model-calls").read_text() == called, "a re-run called the model"
    assert rerun_log.read_text().count("replays its") == replays


def resumes(logs: list[Path]) -> list[int]:
    """How many recorded steps each resumed episode had, as the workers' logs say."""
    return [int(n) for log in logs for n in re.findall(r"resumes after (\d+) recorded steps", log.read_text())]


class ForkedLife:
    """One life of a worker forked from multiprocessing's fork server: what ``run_with_kills`` and the tests use of a
    ``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``; -9 after a SIGKILL)."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _life(script: str, argv: list[str], log: str, env: dict[str, str]) -> None:
    """A worker's life in a forked child: ``python script *argv`` with its output appended to ``log``."""
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.update(env)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


#: how often ``run_with_kills`` kills forked workers: they are at work within a fraction of a second of a restart and
#: finish a share in about 10 s on a quiet machine (at 0.1-0.4 s the TRL test made only 11 of its 20 kills there)
FORKED_EVERY = (0.05, 0.2)


def forked_workers(preload: list[str]) -> Callable[..., ForkedLife]:
    """``start(script, argv, log, env={})``: a worker life forked from a fork server that imported ``preload`` (the
    worker's framework) once. Each life is still a process of its own, killed with SIGKILL and started again on the
    same work with nothing in memory from the one before (the fork server never runs a worker); what a restart saves is
    the framework's imports, about 10 s of CPU each, which made the kill tests' 20 restarts most of their minutes.
    Such workers finish their work sooner: kill them ``every=FORKED_EVERY``."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(preload)

    def start(script: str | Path, argv: list[str], log: Path, env: dict[str, str] | None = None) -> ForkedLife:
        process = context.Process(target=_life, args=(str(script), argv, str(log), env or {}))
        process.start()
        return ForkedLife(process)

    return start

