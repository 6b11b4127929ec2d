"""A run's timeline (issue #69): what rlsync records by itself (a real rollout buffer between a generator thread and a
trainer), that a killed recorder's file still reads and a full one says so, where each pool's time went, the pictures
``rlsync timeline`` writes, and the simulator against what its model must give in closed form."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import rlsync
from rlsync import timeline
from rlsync.core import ConfigError


def _sample(i: int, versions: list[int]) -> rlsync.Sample:
    return rlsync.Sample(f"s{i}", np.arange(3 + len(versions)), 3, np.zeros(len(versions), np.float32),
                         np.asarray(versions), group=f"g{i}")


def test_a_buffer_records_its_stalls_rollouts_waits_staleness_and_publishes(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    buffer = rlsync.make_buffer("memory", batch_size=2, max_staleness=0)
    with rlsync.record_timeline(path):
        def generate() -> None:
            for i in range(4):  # the second batch's admission waits for the trainer's publish: a stall
                ticket = buffer.admit(1)
                assert ticket is not None
                time.sleep(0.02)
                buffer.put([_sample(i, [buffer.version] * (i + 1))], ticket)

        thread = threading.Thread(target=generate)
        thread.start()
        with timeline.span("run", mode="lockstep"):
            for step in (1, 2):
                batch = buffer.get(timeout=10)
                assert batch is not None
                with timeline.span("train", step=step):
                    time.sleep(0.05)
                buffer.publish(step)
        thread.join()
    events = timeline.read_timeline(path)
    kinds = [e["kind"] for e in events]
    assert kinds.count("rollout") == 4 and kinds.count("publish") == 2 and kinds.count("train") == 2
    stalls = [e for e in events if e["kind"] == "stall"]
    assert stalls and all(e["why"] == "staleness bound" and e["end"] > e["start"] for e in stalls)
    waits = [e for e in events if e["kind"] == "wait_batch"]
    assert [w["lags"] for w in waits] == [{"0": 3}, {"0": 7}]  # every token of each batch, of its own version
    assert [e["tokens"] for e in events if e["kind"] == "rollout"] == [1, 2, 3, 4]
    [(run, mine)] = timeline.split_runs(events)
    summary = timeline.summarize_run(run, mine)
    assert summary["run"] == {"mode": "lockstep"} and summary["samples"] == 4
    assert summary["training"]["busy"] == pytest.approx(0.1 / summary["seconds"], abs=0.05)
    assert sum(summary["training"].values()) == pytest.approx(1.0)
    assert sum(summary["generation"].values()) == pytest.approx(1.0)
    assert summary["generation"]["staleness bound"] > 0


def test_nothing_is_recorded_or_opened_without_the_option(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert timeline.recording().path is None
    buffer = rlsync.make_buffer("memory", batch_size=1)
    buffer.put([_sample(0, [0])], buffer.admit(1))
    assert buffer.get(timeout=1) is not None
    assert list(tmp_path.iterdir()) == []


_FROM_NOW = """
import sys
from rlsync.core import record_from_now, recording
first = record_from_now(sys.argv[1])
assert record_from_now(sys.argv[2]) is first is recording()  # the recorder already on stays
recording().event("train")
"""


def test_an_adapters_option_records_from_now_to_the_end_of_the_process(tmp_path: Path) -> None:
    """``record_from_now`` (verl's ``engine_kwargs.rlsync.timeline`` in every process): on until the process ends, once;
    where ``RLSYNC_TIMELINE`` is set, that recorder stays and the option's path is not opened."""
    subprocess.run([sys.executable, "-c", _FROM_NOW, str(tmp_path / "a"), str(tmp_path / "b")], check=True)
    assert [e["kind"] for e in timeline.read_timeline(tmp_path / "a")] == ["process", "train"]
    assert not (tmp_path / "b").exists()
    env = {**os.environ, "RLSYNC_TIMELINE": str(tmp_path / "env.jsonl")}
    subprocess.run([sys.executable, "-c", _FROM_NOW, str(tmp_path / "c"), str(tmp_path / "d")], check=True, env=env)
    assert [e["kind"] for e in timeline.read_timeline(tmp_path / "env.jsonl")] == ["process", "train"]
    assert not (tmp_path / "c").exists()


_RECORD_FOREVER = """
import sys, rlsync
from rlsync import timeline
with rlsync.record_timeline(sys.argv[1]):
    print("recording", flush=True)
    i = 0
    while True:
        timeline.recording().event("request", 1.0 * i, 1.0 * i + 0.5, sequences=4, tokens=40, note="x" * (i % 500))
        i += 1
"""


def test_a_run_killed_mid_way_leaves_a_timeline_that_reads(tmp_path: Path) -> None:
    """SIGKILL while the recorder writes as fast as it can (one process per directory: ``<host>-<pid>.jsonl``): every
    whole line reads back; a cut last line is skipped."""
    proc = subprocess.Popen([sys.executable, "-c", _RECORD_FOREVER, str(tmp_path) + os.sep], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "recording"
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    [file] = tmp_path.glob("*.jsonl")
    assert file.name.endswith(f"-{proc.pid}.jsonl")
    with open(file, "ab") as cut:
        cut.write(b'{"kind": "request", "start": 1.0, "en')  # as a write cut by the kill would leave it
    events = timeline.read_timeline(tmp_path)
    requests = [e for e in events if e["kind"] == "request"]
    assert len(requests) > 100 and all(e["tokens"] == 40 for e in requests)


def test_a_full_recorder_stops_and_says_so(tmp_path: Path) -> None:
    path = tmp_path / "small.jsonl"
    with rlsync.record_timeline(path, max_bytes=2000):
        for i in range(100):
            timeline.recording().event("request", float(i), i + 0.5, sequences=1, tokens=3)
    assert path.stat().st_size < 2200
    assert json.loads(path.read_text().splitlines()[-1])["kind"] == "truncated"  # the last line written
    events = timeline.read_timeline(path)
    assert sum(e["kind"] == "truncated" for e in events) == 1 and 5 < sum(e["kind"] == "request" for e in events) < 40
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "timeline", str(path)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0 and "size bound" in out.stdout


def _write(path: Path, events: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(e) + "\n" for e in events))
    return path


def test_the_shares_count_each_moment_once_for_its_first_reason(tmp_path: Path) -> None:
    """A 10 s run by hand: requests 0-4 and 6-9 (a sync 4-5 inside nothing), a stall 5-6; the trainer waits 0-4, trains
    4.0-4.5 (its sync 4.5-5: the engine's is 4-5), then publishes at 5 and waits for stragglers until 9.5."""
    events = [{"kind": "run", "start": 0.0, "end": 10.0, "mode": "x"},
              {"kind": "request", "start": 0.0, "end": 4.0}, {"kind": "request", "start": 1.0, "end": 3.0},
              {"kind": "request", "start": 6.0, "end": 9.0}, {"kind": "sync", "start": 4.0, "end": 5.0, "route": "r"},
              {"kind": "stall", "start": 5.0, "end": 6.0}, {"kind": "wait_batch", "start": 0.0, "end": 4.0,
                                                            "samples": 4, "lags": {"0": 30, "1": 10}},
              {"kind": "train", "start": 3.5, "end": 4.5}, {"kind": "publish", "start": 5.0, "version": 1},
              {"kind": "wait_batch", "start": 9.0, "end": 9.5, "samples": 4, "lags": {"1": 40}}]
    [(run, mine)] = timeline.split_runs(timeline.read_timeline(_write(tmp_path / "t.jsonl", events)))
    s = timeline.summarize_run(run, mine)
    assert s["generation"] == pytest.approx({"busy": 0.7, "sync": 0.1, "staleness bound": 0.1,
                                             "waiting for the trainer": 0.1})
    assert s["training"] == pytest.approx({"busy": 0.1, "sync": 0.05, "waiting for a batch": 0.4, "ending": 0.45,
                                           "waiting for stragglers": 0.0})
    assert s["staleness"] == {"0": 30, "1": 50} and s["samples"] == 8 and s["sync_seconds"] == pytest.approx(1.0)


@pytest.mark.parametrize("in_flight", [False, True])
def test_the_trainers_time_between_its_spans_is_its_own_work_unless_requests_are_in_flight(tmp_path: Path,
                                                                                           in_flight: bool) -> None:
    """A 10 s lockstep-like run: the trainer waits for its batch 0-4, does something unrecorded 4-5 (rewards, say),
    trains 5-6, syncs 6-7. With no request in flight at 4-5 that second is its own work (busy); with one (a straggler
    of the batch) it waits for it."""
    events = [{"kind": "run", "start": 0.0, "end": 10.0}, {"kind": "request", "start": 0.0, "end": 4.0},
              {"kind": "wait_batch", "start": 0.0, "end": 4.0, "samples": 4, "lags": {"0": 10}},
              {"kind": "train", "start": 5.0, "end": 6.0}, {"kind": "sync", "start": 6.0, "end": 7.0, "route": "r"},
              {"kind": "publish", "start": 7.0, "version": 1}]
    if in_flight:
        events.append({"kind": "request", "start": 3.0, "end": 5.0})
    [(run, mine)] = timeline.split_runs(timeline.read_timeline(_write(tmp_path / "t.jsonl", events)))
    own = 0.0 if in_flight else 0.1
    assert timeline.summarize_run(run, mine)["training"] == pytest.approx(
        {"busy": 0.1 + own, "sync": 0.1, "waiting for a batch": 0.4, "ending": 0.3, "waiting for stragglers": 0.1 - own})


def test_rlsync_timeline_prints_the_shares_and_writes_a_trace_and_a_picture(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    events = [{"kind": "run", "start": 0.0, "end": 2.0}] + [
        {"kind": "request", "start": 0.1 * i, "end": 0.1 * i + 0.5, "sequences": 2, "tokens": 10} for i in range(10)] + [
        {"kind": "train", "start": 1.5, "end": 1.8}, {"kind": "sync", "start": 1.8, "end": 1.9, "route": "r"},
        {"kind": "publish", "start": 1.9, "version": 1}]
    path = _write(tmp_path / "run.jsonl", events)
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "timeline", str(path)], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert "generation" in out.stdout and "waiting for the trainer" in out.stdout
    trace = json.loads((tmp_path / "run.trace.json").read_text())["traceEvents"]
    requests = [e for e in trace if e.get("name") == "request"]
    assert len(requests) == 10 and len({e["tid"] for e in requests}) == 5  # 5 in flight at once: 5 rows
    assert requests[3]["ts"] == pytest.approx(3e5) and requests[3]["dur"] == pytest.approx(5e5)
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "-m", "rlsync.cli", "timeline", str(tmp_path / "nope")],
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "rlsync.record_timeline" in missing.stderr


COSTS = dict(step_seconds=0.01, seq_step_seconds=0.0, request_overhead=0.02, train_seconds=0.1, sync_seconds=0.05,
             lengths=[10], group=2, prompts=2)


def test_the_simulator_gives_lockstep_in_closed_form_and_overlap_with_staleness() -> None:
    costs = timeline.Costs(**COSTS)  # type: ignore[arg-type]
    lockstep = timeline.simulate(costs, "lockstep", 10)
    # one step: the batch's two requests at once (10 tokens, then their overhead), train, sync
    assert lockstep["samples_per_second"] == pytest.approx(4 / (0.02 + 10 * 0.01 + 0.1 + 0.05))
    assert lockstep["staleness"] == {"0": 1.0}
    assert lockstep["idle"]["training"]["waiting for a batch"] == pytest.approx(0.12 / 0.27)
    one_off = timeline.simulate(costs, "one-step-off", 10)
    # the next batch is generated while the trainer trains (0.12 s of it against 0.1): a step is 0.12 + the sync, and
    # the first batch is generated alone
    assert one_off["samples_per_second"] == pytest.approx(40 / (0.12 + 10 * (0.12 + 0.05)))
    assert set(one_off["staleness"]) == {"0", "1"}
    partial = timeline.simulate(costs, "async-partial", 10)
    assert partial["samples_per_second"] > lockstep["samples_per_second"]
    with pytest.raises(ConfigError, match="one of lockstep"):
        timeline.simulate(costs, "fully-async", 3)


def test_the_simulator_replays_the_recorded_lengths_in_their_order() -> None:
    costs = timeline.Costs(**{**COSTS, "lengths": [10, 10, 100, 100]})  # type: ignore[arg-type]

    def step(length: int) -> float:  # one lockstep step: a batch of two requests of this length, train, sync
        return 0.02 + length * 0.01 + 0.1 + 0.05

    # batches of two requests: 10 and 10, then 100 and 100, then from the first again
    replayed = timeline.simulate(costs, "lockstep", 4, seed=None)
    assert replayed["wall_seconds"] == pytest.approx(2 * step(10) + 2 * step(100))
    predicted = timeline.predict(costs, ["lockstep"], 4, replay=True)["lockstep"]["samples_per_second"]
    assert predicted == pytest.approx(16 / (2 * step(10) + 2 * step(100)))
    drawn = [timeline.simulate(costs, "lockstep", 4, seed=s)["wall_seconds"] for s in range(10)]
    assert max(drawn) > 2 * step(10) + 2 * step(100)  # a draw pairs a 10 with a 100: the batch waits for the 100


def test_a_simulated_run_ends_with_its_last_sync_not_with_the_requests_still_in_flight() -> None:
    """With partial rollouts the last sync does not wait for the requests in flight: a 1,000-token one started beside
    the first batch's is never trained on in a run of one step, and the run does not wait for it."""
    costs = timeline.Costs(**{**COSTS, "lengths": [10, 1000], "prompts": 1, "group": 1})  # type: ignore[arg-type]
    run = timeline.simulate(costs, "async-partial", 1, seed=None)
    # the 10-token request (0.1 s and its 0.02 s overhead), a step (0.1 s), the pause (a request's fixed cost and an
    # engine step), the sync (0.05 s) and the resume (the fixed cost again)
    assert run["wall_seconds"] == pytest.approx(0.02 + 10 * 0.01 + 0.1 + (0.02 + 0.01) + (0.05 + 0.02))


def test_fit_costs_recovers_the_engine_and_trainer_costs_of_a_run(tmp_path: Path) -> None:
    """Requests alone (none beside another): seconds = overhead + length * (step + sequences * per-sequence step)."""
    d, a, c = 0.02, 0.005, 0.001
    events: list[dict[str, object]] = [{"kind": "run", "start": 0.0, "end": 10.0}]
    at = 0.0
    for length, n in ((10, 2), (20, 4), (5, 1), (30, 2), (8, 3)):
        seconds = d + length * (a + c * n)
        events.append({"kind": "request", "start": at, "end": at + seconds, "sequences": n, "tokens": length * n})
        at += seconds + 0.1
    events += [{"kind": "train", "start": 8.0, "end": 8.3}, {"kind": "sync", "start": 8.3, "end": 8.5, "route": "r"},
               {"kind": "wait_batch", "start": 7.0, "end": 8.0, "samples": 4, "lags": {"0": 10}}]
    costs = timeline.fit_costs(events[::-1])  # in any order: the lengths come in the order the requests started
    assert costs.lengths == [10, 20, 5, 30, 8]
    assert (costs.request_overhead, costs.step_seconds, costs.seq_step_seconds) == pytest.approx((d, a, c), abs=1e-9)
    assert (costs.train_seconds, costs.sync_seconds, costs.prompts, costs.group) == pytest.approx((0.3, 0.2, 2, 2))
    with pytest.raises(ConfigError, match="at least 3"):
        timeline.fit_costs(events[:3])


def test_rlsync_simulate_takes_costs_as_flags_and_names_the_ones_missing() -> None:
    flags = ["--step-seconds", "0.01", "--seq-step-seconds", "0", "--train-seconds", "0.1", "--sync-seconds", "0.05",
             "--lengths", "10", "--prompts", "2", "--group", "2", "--steps", "10", "--repeats", "2"]
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "simulate", *flags, "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    modes = json.loads(out.stdout)["modes"]
    assert list(modes) == list(timeline.MODES)
    assert modes["lockstep"]["samples_per_second"] == pytest.approx(4 / (10 * 0.01 + 0.1 + 0.05))
    short = subprocess.run([sys.executable, "-m", "rlsync.cli", "simulate", "--train-seconds", "1"], capture_output=True,
                           text=True)
    assert short.returncode == 2 and "--step-seconds" in short.stderr and "--timeline" in short.stderr
