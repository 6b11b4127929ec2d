"""A run's timeline, recorded as it happens (issue #69): one JSON object a line, appended and flushed per event, so
that a run killed mid-way leaves every line but perhaps its last, and a reader skips a cut last line.

What rlsync records by itself once a recorder is on: the rollout buffer's admission stalls (``stall``), each ticket
from admission to its samples (``rollout``: tokens, the versions they carry), the trainer's waits for a batch
(``wait_batch``) and the batches it takes (``batch``: the tokens' staleness), each published version (``publish``),
dropped samples (``drop``), and each weight sync a writer completes (``sync``: bytes, transport). What only the
caller knows it records with ``span``: a generation request (``request``) as the engine served it, the trainer's own
step (``train``), the run itself (``run``: the window the shares are of).

Off by default. ``record_timeline(path)`` (or ``RLSYNC_TIMELINE=path`` in the environment, read once when rlsync
first records) turns it on for this process: ``path`` a ``.jsonl`` file, or a directory (any other path) that gets
one file per process, ``<host>-<pid>.jsonl``, so that every rank of a run can record into one directory. Bounded:
past ``max_bytes`` (default 256 MiB) the recorder writes one ``truncated`` line and stops.

Times are Unix seconds (``time.time()`` at the recorder's start plus ``perf_counter`` since), so the files of several
processes on one host merge onto one clock.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from rlsync.core._errors import ConfigError

ENV = "RLSYNC_TIMELINE"
#: the recorder's size bound by default: far above what a day's run records (an event is about 150 bytes)
DEFAULT_MAX_BYTES = 256 << 20
_encode = msgspec.json.Encoder().encode


class Recorder:
    """Appends events to one file. Thread-safe; ``close`` (or the end of ``record_timeline``'s block) ends it."""

    def __init__(self, path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        target = Path(path)
        if target.suffix != ".jsonl" or target.is_dir():  # a directory: every process of a run records into it
            target.mkdir(parents=True, exist_ok=True)
            target = target / f"{socket.gethostname()}-{os.getpid()}.jsonl"
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(target, "ab", buffering=0)  # unbuffered: each event is one write(2), whole lines survive
        except OSError as exc:
            raise ConfigError(f"cannot record the timeline at {str(path)!r} ({exc.strerror}): give {ENV} or "
                              "record_timeline() a writable file or directory") from None
        self.path = target
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._written = 0
        self._origin = (time.time(), time.perf_counter())
        self.event("process", pid=os.getpid(), host=socket.gethostname())

    def now(self) -> float:
        """Unix seconds, on this recorder's clock (monotonic within the process)."""
        return self._origin[0] + (time.perf_counter() - self._origin[1])

    def event(self, kind: str, start: float | None = None, end: float | None = None, **fields: Any) -> None:
        """One event: ``kind``, its ``start`` (default now) and, for a span, its ``end``; ``fields`` must be JSON."""
        record = {"kind": kind, "start": self.now() if start is None else start, **({} if end is None else {"end": end}),
                  **fields}
        line = _encode(record) + b"\n"
        with self._lock:
            if self._file.closed or self._written < 0:
                return
            if self._written + len(line) > self.max_bytes:
                self._file.write(_encode({"kind": "truncated", "start": record["start"], "max_bytes": self.max_bytes})
                                 + b"\n")
                self._written = -1  # full: nothing more
                return
            self._file.write(line)
            self._written += len(line)

    @contextlib.contextmanager
    def span(self, kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Record ``kind`` from entering to leaving the block; the dict it yields adds fields known only at the end
        (a request's tokens, say), or replaces one given at the start."""
        extra: dict[str, Any] = {}
        start = self.now()
        try:
            yield extra
        finally:
            self.event(kind, start, self.now(), **{**fields, **extra})  # what the block learned wins

    def close(self) -> None:
        with self._lock:
            self._file.close()


class _Off:
    """What ``recording()`` returns when no timeline is recorded: every call does nothing, at the cost of a call."""

    path = None

    def now(self) -> float:
        return time.time()

    def event(self, kind: str, start: float | None = None, end: float | None = None, **fields: Any) -> None:
        pass

    @contextlib.contextmanager
    def span(self, kind: str, **fields: Any) -> Iterator[dict[str, Any]]:
        yield {}

    def close(self) -> None:
        pass


OFF = _Off()
_current: Recorder | _Off | None = None  # None: the environment not read yet
_current_lock = threading.Lock()


def recording() -> Recorder | _Off:
    """This process's recorder, or one that records nothing (``RLSYNC_TIMELINE`` is read on the first call)."""
    global _current
    if _current is None:
        with _current_lock:
            if _current is None:
                where = os.environ.get(ENV, "").strip()
                _current = Recorder(where) if where else OFF
    return _current


@contextlib.contextmanager
def record_timeline(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[Recorder]:
    """Record this process's timeline into ``path`` (a ``.jsonl`` file, or a directory for one file per process)
    within the block; the recorder that was on before (or none) is back after it."""
    global _current
    recorder = Recorder(path, max_bytes=max_bytes)
    with _current_lock:
        before, _current = _current, recorder
    try:
        yield recorder
    finally:
        with _current_lock:
            _current = before
        recorder.close()


def record_from_now(path: str | os.PathLike[str]) -> Recorder:
    """Record this process's timeline into ``path`` from now until the process ends: what a framework adapter's option
    turns on in every process it reaches (verl's ``engine_kwargs.rlsync.timeline``). A recorder already on (the
    environment's ``RLSYNC_TIMELINE``, an enclosing ``record_timeline``, an earlier call) stays, and is returned."""
    global _current
    current = recording()
    if isinstance(current, Recorder):
        return current
    with _current_lock:
        if not isinstance(_current, Recorder):
            _current = Recorder(path)
        return _current


def span(kind: str, **fields: Any) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """``recording().span(kind, **fields)``: a span of what only the caller knows (``request``, ``train``, ``run``)."""
    return recording().span(kind, **fields)
