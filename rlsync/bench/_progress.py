"""Progress and notices of ``rlsync bench``, on stderr: a bar with an ETA on a terminal, plain lines elsewhere (CI
logs, pipes), so a long run always says where it is; and what a run skipped and why, so no path is left out quietly."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol


class Advance(Protocol):
    def __call__(self, step: str, units: int = 1) -> None: ...


@contextmanager
def progress(total: int | None, what: str = "benchmark") -> Iterator[Advance]:
    """Yields ``advance(step, units=1)``: ``units`` more of ``total`` are done (``None``: a count not known ahead,
    then no ETA), the current one is ``step``."""
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("eta"), TimeRemainingColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(what, total=total)
            yield lambda step, units=1: bar.update(task, advance=units, description=step)
        return
    started, done = time.monotonic(), 0

    def line(step: str, units: int = 1) -> None:
        nonlocal done
        done += units
        elapsed = time.monotonic() - started
        if total is None:
            print(f"{what}: {step} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
            return
        left = f", about {elapsed / done * (total - done):.0f} s left" if 0 < done < total else ""
        print(f"{what}: {step} ({done}/{total}, {elapsed:.0f} s{left})", file=sys.stderr, flush=True)

    yield line


def say_skipped(skipped: list[dict[str, Any]]) -> None:
    """One line per path the run left out, with the reason and what would include it."""
    for item in skipped:
        print(f"skipped {item['name']}: {item['why']}", file=sys.stderr, flush=True)
