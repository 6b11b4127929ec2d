"""``rlsync timeline RUN`` and ``rlsync simulate``: the tables they print and the files they write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from rlsync.core import ConfigError
from rlsync.timeline import MODES, Costs, chrome_trace, fit_costs, gantt, predict, read_timeline, split_runs, summarize_run


def _pct(share: float) -> str:
    return f"{100 * share:.1f}%"


def _title(fields: dict[str, Any], index: int) -> str:
    return ", ".join(f"{k} {v}" for k, v in fields.items()) or f"run {index + 1}"


def timeline_command(path: Path, picture: Path | None, trace: Path | None, as_json: bool) -> None:
    events = read_timeline(path)
    summaries = [summarize_run(run, mine) for run, mine in split_runs(events)]
    stem = path / "timeline" if path.is_dir() else path.with_suffix("")
    trace = trace or stem.with_name(stem.name + ".trace.json")
    trace.write_text(json.dumps(chrome_trace(events)))
    pictured = _picture(events, picture or stem.with_name(stem.name + ".png"))
    if as_json:
        print(json.dumps({"runs": summaries, "trace": str(trace), "picture": pictured and str(pictured)}, indent=1))
        return
    console = Console()
    for index, s in enumerate(summaries):
        table = Table(title=f"{_title(s['run'], index)}: {s['seconds']:.1f} s, {s['samples']} samples trained "
                            f"({s['samples_per_second']:.2f}/s), {s['requests']} requests, {s['syncs']} syncs of "
                            f"{s['sync_seconds']:.2f} s", title_justify="left")
        table.add_column("pool")
        table.add_column("busy", justify="right")
        table.add_column("idle, and on what it waits")
        for pool in ("generation", "training"):
            shares = s[pool]
            idle = ", ".join(f"{why} {_pct(v)}" for why, v in shares.items() if why != "busy" and v >= 0.0005)
            table.add_row(pool, _pct(shares["busy"]), idle or "-")
        console.print(table)
        total = sum(s["staleness"].values())
        lags = ", ".join(f"{lag} behind {_pct(n / total)}" for lag, n in s["staleness"].items()) if total else "-"
        console.print(f"  staleness of the tokens trained on: {lags}" + (f"; {s['drops']} samples dropped" if s["drops"]
                                                                          else ""))
        if s["truncated"]:
            console.print("  [yellow]the recorder reached its size bound: the run's end is missing[/yellow]")
    console.print(f"trace: {trace} (chrome://tracing or ui.perfetto.dev)" + (f"; picture: {pictured}" if pictured else ""))


def _picture(events: list[dict[str, Any]], where: Path) -> Path | None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        Console(stderr=True).print("no picture: it needs matplotlib (pip install matplotlib); the trace is written")
        return None
    gantt(events, where)
    return where


def simulate_command(path: Path | None, run: int, modes: list[str], steps: int | None, max_staleness: int,
                     overrides: dict[str, Any], as_json: bool, repeats: int, replay: bool = False) -> None:
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"--modes {mode}: one of {', '.join(MODES)}")
    given = {k: v for k, v in overrides.items() if v is not None}
    if path is not None:
        runs = split_runs(read_timeline(path))
        if not 0 <= run < len(runs):
            raise ConfigError(f"--run {run}: the timeline has runs 0 to {len(runs) - 1}")
        costs = fit_costs(runs[run][1] + [runs[run][0]])
        steps = steps or sum(1 for e in runs[run][1] if e["kind"] == "train")
    else:
        missing = [f"--{k.replace('_', '-')}" for k in ("step_seconds", "seq_step_seconds", "train_seconds",
                                                         "sync_seconds", "lengths", "prompts", "group") if k not in given]
        if missing:
            raise ConfigError(f"without --timeline, rlsync simulate needs the costs as flags: {', '.join(missing)} "
                              "(or --timeline RUN, a run recorded with rlsync.record_timeline)")
        costs = Costs(request_overhead=0.0, **{k: given.pop(k) for k in ("step_seconds", "seq_step_seconds",
                                                                           "train_seconds", "sync_seconds", "lengths",
                                                                           "prompts", "group")})
    for k, v in given.items():
        setattr(costs, k, v)
    steps = steps or 20
    predicted = predict(costs, modes, steps, max_staleness=max_staleness, repeats=repeats, replay=replay)
    if as_json:
        print(json.dumps({"costs": vars(costs) | {"lengths": len(costs.lengths)}, "steps": steps, "modes": predicted},
                         indent=1))
        return
    console = Console()
    console.print(f"costs: engine step {1e3 * costs.step_seconds:.2f} ms + {1e3 * costs.seq_step_seconds:.3f} ms a "
                  f"sequence, {1e3 * costs.request_overhead:.1f} ms a request; train {costs.train_seconds:.3f} s "
                  f"(+{costs.other_seconds:.3f} s); sync {costs.sync_seconds:.3f} s; batch {costs.prompts} prompts x "
                  f"{costs.group}; {len(costs.lengths)} lengths, mean {sum(costs.lengths) / len(costs.lengths):.1f}, "
                  + ("taken in the run's order" if replay else f"drawn at random ({repeats} runs)"))
    table = Table(title=f"predicted, {steps} steps, max staleness {max_staleness} (async)", title_justify="left")
    for column in ("mode", "samples/s", "vs lockstep", "generation idle", "training idle", "staleness (tokens)"):
        table.add_column(column, justify="right" if column in ("samples/s", "vs lockstep") else "left")
    base = predicted.get("lockstep", {}).get("samples_per_second")
    for mode, p in predicted.items():
        idle = {pool: ", ".join(f"{why} {_pct(v)}" for why, v in reasons.items() if v >= 0.0005) or "-"
                for pool, reasons in p["idle"].items()}
        table.add_row(mode, f"{p['samples_per_second']:.2f}", f"{p['samples_per_second'] / base:.2f}x" if base else "-",
                      idle["generation"], idle["training"],
                      ", ".join(f"{k}: {_pct(v)}" for k, v in p["staleness"].items()))
    console.print(table)
