"""Where a run's time went, per pool, from its timeline: the share of the run each pool was busy, and of the rest,
what it waited for.

The generation pool is busy while a request is in flight and not paused by a sync (``request`` spans; where the
caller recorded none, the buffer's ``rollout`` spans, admission to put, stand in). Idle, it waits for a sync
(``sync`` spans, and with partial rollouts from a ``pause`` to the end of the next ``resume``), for the staleness
bound (the buffer's admission ``stall`` spans), or otherwise for the trainer.

The training pool is busy in its ``train`` spans (the caller's), and in a sync (``sync`` and ``resume`` spans). Idle,
it waits for a batch (the buffer's ``wait_batch`` spans) or for the stragglers: requests still in flight that a sync
waits for (or that a ``pause`` waits to freeze). Its time outside all of these with no request in flight and no
pause under way is its own work between steps (rewards, batching): busy. After its last step (its last ``publish``)
the run is ``ending``: generators finishing what they started. Where no ``train`` span was recorded, the rest is
``busy or waiting``.

Each figure is a share of the run's window (its ``run`` span); a moment counts once, for the first reason it has in
the order given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Interval = tuple[float, float]


def union(spans: Iterable[Interval], window: Interval) -> list[Interval]:
    """The spans clipped to ``window`` and merged, in order."""
    lo, hi = window
    out: list[Interval] = []
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in spans):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def minus(spans: list[Interval], taken: list[Interval]) -> list[Interval]:
    """The parts of merged ``spans`` outside merged ``taken``."""
    out: list[Interval] = []
    for start, end in spans:
        cursor = start
        for t0, t1 in taken:
            if t1 <= cursor or t0 >= end:
                continue
            if t0 > cursor:
                out.append((cursor, t0))
            cursor = max(cursor, t1)
        if cursor < end:
            out.append((cursor, end))
    return out


def length(spans: list[Interval]) -> float:
    return sum(e - s for s, e in spans)


def _spans(events: list[dict[str, Any]], kind: str) -> list[Interval]:
    return [(e["start"], e["end"]) for e in events if e["kind"] == kind and "end" in e]


def _shares(reasons: list[tuple[str, list[Interval]]], window: Interval) -> dict[str, float]:
    """Each reason's share of the window, a moment counted for the first reason that holds it; the rest last."""
    seconds = window[1] - window[0]
    taken: list[Interval] = []
    out = {}
    for reason, spans in reasons:
        mine = minus(union(spans, window), taken)
        out[reason] = length(mine) / seconds if seconds > 0 else 0.0
        taken = union(taken + mine, window)
    return out


def summarize_run(run: dict[str, Any], events: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures: each pool's shares, the staleness of the tokens trained on, syncs, samples."""
    window = (run["start"], run["end"])
    seconds = window[1] - window[0]
    syncs = union(_spans(events, "sync"), (float("-inf"), float("inf")))  # a writer's sync inside an engine's is one
    resumes = _spans(events, "resume")
    pauses = _spans(events, "pause")
    paused = [(start, next((e for s, e in resumes if e >= start), window[1])) for start, _ in pauses]
    requests = _spans(events, "request") or [s for s in _spans(events, "rollout") if s[1] > s[0]]
    generating = union(syncs + paused, window)
    generation = _shares([("busy", minus(union(requests, window), generating)), ("sync", generating),
                          ("staleness bound", _spans(events, "stall")),
                          ("waiting for the trainer", [window])], window)
    train = _spans(events, "train")
    last = max((e["start"] for e in events if e["kind"] == "publish"), default=window[1])
    idle = [("sync", syncs + resumes), ("waiting for a batch", _spans(events, "wait_batch")),
            ("ending", [(last, window[1])])]
    if train:  # outside its spans the trainer waits for stragglers while requests are in flight, else works on its own
        training = _shares([("busy", train), *idle, ("waiting for stragglers", requests + pauses), ("own work", [window])],
                           window)
        training["busy"] += training.pop("own work")  # rewards, batching: between its spans, with nothing in flight
    else:
        training = _shares([("busy", train), *idle, ("busy or waiting", [window])], window)
    lags: dict[int, int] = {}
    samples = 0
    for e in events:  # the buffer's wait_batch, or a trainer's own batch event, carries the staleness of its tokens
        if "lags" in e:
            samples += int(e.get("samples", 0))
            for lag, count in e["lags"].items():
                lags[int(lag)] = lags.get(int(lag), 0) + int(count)
    sync_seconds = [e - s for s, e in syncs if window[0] <= s <= window[1]]
    fields = {k: v for k, v in run.items() if k not in ("kind", "start", "end")}
    return {"run": fields, "seconds": seconds, "samples": samples,
            "samples_per_second": samples / seconds if seconds > 0 else 0.0,
            "generation": generation, "training": training,
            "staleness": {str(k): lags[k] for k in sorted(lags)},
            "syncs": len(sync_seconds), "sync_seconds": sum(sync_seconds) / len(sync_seconds) if sync_seconds else 0.0,
            "requests": len(requests), "drops": sum(int(e.get("samples", 0)) for e in events if e["kind"] == "drop"),
            "truncated": any(e["kind"] == "truncated" for e in events)}
