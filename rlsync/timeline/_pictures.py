"""A timeline as pictures: Chrome trace events (``chrome://tracing`` and Perfetto open them: one process per pool, a
row per concurrent request, zoom into one step) and a Gantt chart of both pools across versions (PNG, matplotlib)."""

from __future__ import annotations

import os
from typing import Any

#: which pool's row each kind of span goes in, and its colour in the chart
_POOL = {"request": "generation", "rollout": "generation", "stall": "generation", "train": "training",
         "wait_batch": "training", "sync": "sync", "pause": "sync", "resume": "sync"}
_COLOUR = {"request": "tab:green", "rollout": "tab:olive", "stall": "tab:gray", "train": "tab:purple",
           "wait_batch": "plum", "sync": "tab:red", "pause": "salmon", "resume": "salmon"}


def _rows(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str, int]]:
    """Each span with its row key (its kind; requests and rollouts share one) and a row under that key in which it
    overlaps no other (greedy, by start): concurrent requests take a row each."""
    ends: dict[str, list[float]] = {}
    out = []
    recorded = any(e["kind"] == "request" for e in events)  # then the buffer's rollouts would draw them twice
    for e in events:
        if e["kind"] not in _POOL or "end" not in e or (recorded and e["kind"] == "rollout"):
            continue
        key = {"rollout": "request", "pause": "sync", "resume": "sync"}.get(e["kind"], e["kind"])
        lanes = ends.setdefault(key, [])
        row = next((i for i, end in enumerate(lanes) if end <= e["start"]), len(lanes)) if key == "request" else 0
        if row == len(lanes):
            lanes.append(e["end"])
        lanes[row] = e["end"]
        out.append((e, key, row))
    return out


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The timeline as Chrome trace events (``{"traceEvents": [...]}``, microseconds from the first event)."""
    origin = events[0]["start"] if events else 0.0
    pids = {"generation": 1, "training": 2, "sync": 3}
    trace: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{pool} pool" if
                                    pool != "sync" else "weight syncs"}} for pool, pid in pids.items()]
    for e, key, row in _rows(events):
        args = {k: v for k, v in e.items() if k not in ("kind", "start", "end")}
        trace.append({"ph": "X", "name": e["kind"], "pid": pids[_POOL[e["kind"]]],
                      "tid": row if key == "request" else 1000 + list(_POOL).index(key),
                      "ts": (e["start"] - origin) * 1e6, "dur": (e["end"] - e["start"]) * 1e6, "args": args})
    for e in events:
        if e["kind"] == "publish":
            trace.append({"ph": "i", "s": "g", "name": f"version {e.get('version')}", "pid": pids["training"], "tid": 0,
                          "ts": (e["start"] - origin) * 1e6})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def gantt(events: list[dict[str, Any]], where: str | os.PathLike[str], title: str = "") -> None:
    """A Gantt chart of both pools (requests in green, the trainer's steps in purple, its waits for a batch in plum,
    admission stalls in grey, syncs in red), each published version a dotted line, as a PNG at ``where``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = events[0]["start"] if events else 0.0
    rows = _rows(events)
    requests = max((row for _, key, row in rows if key == "request"), default=0) + 1
    order = [("train", "training: step", 1), ("wait_batch", "training: waits for a batch", 1),
             ("sync", "weight sync", 1), ("stall", "generation: admission stall", 1),
             ("request", "generation: requests", requests)]
    base: dict[str, int] = {}
    labels: dict[int, str] = {}
    for key, label, count in order:
        base[key] = len(labels)
        labels.update({len(labels) + i: label if i == 0 else "" for i in range(count)})
    fig, ax = plt.subplots(figsize=(14, 1.5 + 0.22 * len(labels)))
    for e, key, row in rows:
        at = base[key] + (row if key == "request" else 0)
        ax.broken_barh([(e["start"] - origin, e["end"] - e["start"])], (at + 0.1, 0.8), color=_COLOUR[e["kind"]])
    for e in events:
        if e["kind"] == "publish":
            ax.axvline(e["start"] - origin, color="black", linestyle=":", linewidth=0.6)
    ax.set_yticks(list(labels), list(labels.values()))
    ax.set_xlabel("seconds")
    drawn = dict.fromkeys(e["kind"] for e, _, _ in rows)
    handles = [matplotlib.patches.Patch(color=_COLOUR[k], label=k) for k in drawn]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), fontsize=7, ncol=len(handles), frameon=False)
    fig.suptitle(title or "the run's timeline: each pool's spans, each published version a dotted line", fontsize=9)
    fig.tight_layout()
    fig.savefig(where, dpi=110)
    plt.close(fig)
