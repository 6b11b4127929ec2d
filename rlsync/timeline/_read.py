"""Reading a recorded timeline back: one file, or a directory of them (one per process), merged onto one clock; a
line cut by a killed run is skipped, and a recorder that reached its size bound says so."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from rlsync.core import ConfigError

_decode = msgspec.json.Decoder(dict).decode


def read_timeline(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event of the timeline at ``path`` (a ``.jsonl`` file, or a directory of them), by start time."""
    where = Path(path)
    files = sorted(where.glob("*.jsonl")) if where.is_dir() else [where]
    if not where.exists() or not files:
        raise ConfigError(f"no timeline at {str(path)!r}: record one with rlsync.record_timeline(PATH) or "
                          "RLSYNC_TIMELINE=PATH (a file, or a directory of *.jsonl files, one per process)")
    events: list[dict[str, Any]] = []
    for file in files:
        with open(file, "rb") as lines:
            for number, line in enumerate(lines, 1):
                try:
                    event = _decode(line)
                except msgspec.DecodeError:
                    continue  # the line a killed process was writing
                if not isinstance(event.get("kind"), str) or not isinstance(event.get("start"), (int, float)):
                    raise ConfigError(f"{file}:{number} is not a timeline event (no kind and start): is it a timeline "
                                      "rlsync recorded?")
                events.append(event)
    events.sort(key=lambda e: e["start"])
    return events


def split_runs(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """Each ``run`` span with the events that start within it (a run's window is what its shares are of); the whole
    timeline as one run, from its first event to its last end, where no ``run`` span was recorded."""
    runs = [e for e in events if e["kind"] == "run" and "end" in e]
    if not runs:
        whole = {"kind": "run", "start": events[0]["start"] if events else 0.0,
                 "end": max((e.get("end", e["start"]) for e in events), default=0.0)}
        return [(whole, [e for e in events if e["kind"] != "run"])]
    return [(run, [e for e in events if e["kind"] != "run" and run["start"] <= e["start"] <= run["end"]]) for run in runs]
