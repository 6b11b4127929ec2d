"""The rollout buffer between generators and trainers.

Generators ``admit()`` before starting a rollout, then ``put()`` the finished samples; trainers
``get()`` batches (by sample count or by token count) and ``publish(version)`` after each
update. Admission keeps the off-policy lag within ``max_staleness``: everything admitted since
the start (consumed + waiting + in flight) may not exceed ``(version + max_staleness + 1) *
batch_size`` samples. ``consumed`` is part of ``state_dict()``, so the capacity is right after a
restart (in-flight rollouts died with their generators and are not counted again).

``on_stale``: ``"wait"`` makes admission block generators so nothing goes stale; ``"drop"`` lets
them run and drops samples older than the bound when batches are formed. Partial rollouts at a
publish: ``"continue"`` (keep generating; later tokens carry the new version), ``"abort"``
(in-flight tickets are cancelled; their prompts are re-queued) and ``"drain"`` (admit nothing
until the rollouts in flight have finished).

Samples live in a ``Storage`` (in memory by default; Redis streams for durability). The buffer is
thread-safe; ``aadmit``/``aput``/``aget`` serve asyncio code.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np
import pluggy

from rlsync.core._errors import ConfigError, RolloutBufferError, VersionError, whole_number
from rlsync.core.rollouts._gates import Decision, Gate, freshest_per_group, importance_weights
from rlsync.core.hooks import default_plugin_manager
from rlsync.core.rollouts._samples import Sample
from rlsync.core.rollouts._telemetry import BufferTelemetry
from rlsync.core.timeline import recording

PartialPolicy = Literal["continue", "abort", "drain"]
BUILTIN_GATES = "rlsync.plugins.gates"  # the plugin that holds MaxStaleness


def _as_filter(gate: Gate) -> Callable[[Sample, int], Decision | None]:
    """A buffer's own gate as a ``rlsync_gate_sample`` participant: DROP stops the hook; anything else passes on."""

    def rlsync_gate_sample(sample: Sample, trainer_version: int) -> Decision | None:
        return Decision.DROP if gate(sample, trainer_version) is Decision.DROP else None

    return rlsync_gate_sample


@runtime_checkable
class Storage(Protocol):
    """Where a ``RolloutBuffer``'s waiting samples live (``RolloutBuffer(storage=...)``); every method is called
    by the buffer's process, under the buffer's lock. ``rlsync.testing.check_storage`` checks an implementation.

    Must implement all of: ``append`` (keep samples; a ``sample_id`` seen before may be ignored), ``take``
    (hand out up to ``count`` samples, oldest ``oldest_version`` first, first in first out within a version),
    ``ack`` (the trainer got these ids: never hand them out again; a storage shared by processes may hand out
    again what a dead client took and never acknowledged), ``__len__`` (samples waiting, not taken),
    ``load_state``/``save_state`` (the buffer's counters, ``{str: int}``, kept across restarts where the
    storage is durable), ``close``.

    Called on: the process that owns the ``RolloutBuffer`` (generators and trainers reach it through that buffer).
    """

    def append(self, samples: Sequence[Sample]) -> None: ...
    def take(self, count: int) -> list[Sample]: ...
    def ack(self, sample_ids: Sequence[str]) -> None: ...
    def __len__(self) -> int: ...
    def load_state(self) -> dict[str, Any]: ...
    def save_state(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class MemoryStorage:
    """The embedded default: one deque per policy version, taken oldest version first, so a
    rollout that finished late still trains before fresher ones (it is the nearest to stale)."""

    def __init__(self) -> None:
        self._by_version: dict[int, collections.deque[Sample]] = {}
        self._count = 0
        self._state: dict[str, Any] = {}

    def append(self, samples: Sequence[Sample]) -> None:
        for s in samples:
            queue = self._by_version.get(s.oldest_version)
            if queue is None:
                queue = self._by_version[s.oldest_version] = collections.deque()
            queue.append(s)
        self._count += len(samples)

    def take(self, count: int) -> list[Sample]:
        out: list[Sample] = []
        while len(out) < count and self._by_version:
            version = min(self._by_version)
            queue = self._by_version[version]
            while queue and len(out) < count:
                out.append(queue.popleft())
            if not queue:
                del self._by_version[version]
        self._count -= len(out)
        return out

    def ack(self, sample_ids: Sequence[str]) -> None:
        pass  # in-process: what was taken cannot be lost by another process

    def __len__(self) -> int:
        return self._count

    def load_state(self) -> dict[str, Any]:
        return dict(self._state)

    def save_state(self, state: dict[str, Any]) -> None:
        self._state = dict(state)

    def close(self) -> None:
        pass


class Ticket:
    """Admission for one rollout (or one group of rollouts)."""

    __slots__ = ("aborted", "admitted", "count", "prompt_id", "ticket_id", "version")

    def __init__(self, ticket_id: int, version: int, count: int, prompt_id: str | None) -> None:
        self.ticket_id = ticket_id
        self.version = version
        self.count = count
        self.prompt_id = prompt_id
        self.aborted = False
        self.admitted = 0.0  # when (the timeline's clock), for the rollout's span


class Batch:
    """Samples handed to a trainer, with what a loss needs to correct for staleness."""

    def __init__(self, samples: list[Sample], trainer_version: int) -> None:
        self.samples = samples
        self.trainer_version = trainer_version

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    def version_lags(self) -> list[np.ndarray]:
        """Per generated token: trainer version minus the version that produced it."""
        return [self.trainer_version - s.versions for s in self.samples]

    def importance_weights(self, trainer_logprobs: Sequence[np.ndarray], cap: float | None = 2.0) -> list[np.ndarray]:
        """Truncated token-level importance weights against each sample's behaviour log-probs."""
        if len(trainer_logprobs) != len(self.samples):
            raise ValueError(f"{len(trainer_logprobs)} log-prob arrays for a batch of {len(self.samples)} samples")
        return [importance_weights(t, s.logprobs, cap) for t, s in zip(trainer_logprobs, self.samples)]


def _record_rollout(ticket: Ticket | None, samples: list[Sample]) -> None:
    """The timeline's ``rollout``: a ticket from admission to its samples, their tokens and versions."""
    timeline = recording()
    if timeline.path is not None:
        now = timeline.now()
        timeline.event("rollout", now if ticket is None else ticket.admitted, now, samples=len(samples),
                       tokens=sum(len(s.versions) for s in samples),
                       versions=[min(s.oldest_version for s in samples), max(s.newest_version for s in samples)])


def _record_wait(began: float, batch: Batch | None) -> None:
    """The timeline's ``wait_batch``: a trainer's wait in ``get``, and the staleness of each token it took."""
    timeline = recording()
    if timeline.path is not None:
        fields: dict[str, Any] = {}
        if batch is not None:
            lags = np.bincount(np.concatenate(batch.version_lags()).astype(np.int64).clip(0)) if batch.num_tokens else ()
            fields = {"samples": len(batch), "version": batch.trainer_version,
                      "lags": {str(k): int(n) for k, n in enumerate(lags) if n}}
        timeline.event("wait_batch", began, timeline.now(), **fields)


MAX_BATCH_SIZE = 1 << 24  # samples in one batch: far above any trainer's, far below what would never fill


class RolloutBuffer:
    """See the module docstring."""

    def __init__(
        self,
        *,
        batch_size: int,
        max_staleness: int = 1,
        on_stale: Literal["wait", "drop"] = "wait",
        partial: PartialPolicy = "continue",
        group_size: int = 1,
        storage: Storage | None = None,
        gates: Iterable[Gate] = (),
        plugins: pluggy.PluginManager | None = None,
    ) -> None:
        if on_stale not in ("wait", "drop") or partial not in ("continue", "abort", "drain"):
            raise ConfigError(f"on_stale must be 'wait' or 'drop' and partial 'continue', 'abort' or 'drain'; got {on_stale!r}, {partial!r}")
        whole_number("batch_size", batch_size, 1)
        whole_number("group_size", group_size, 1)
        whole_number("max_staleness", max_staleness, 0, "0: on-policy only; admit() would wait forever below it")
        if batch_size > MAX_BATCH_SIZE:  # get() would wait for a batch that never fills
            raise ConfigError(f"batch_size={batch_size!r}: a batch of at most {MAX_BATCH_SIZE:,} samples")
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.partial = partial
        self.group_size = group_size
        self.storage: Storage = storage if storage is not None else MemoryStorage()
        self.gates = list(gates)  # this buffer's own gates, asked before the plugins' (rlsync_gate_sample)
        self.plugins = plugins or default_plugin_manager()
        self._extra_gates = [_as_filter(g) for g in self.gates]
        self.telemetry = BufferTelemetry()
        state = self.storage.load_state()
        self.version = int(state.get("version", 0))
        self.consumed = int(state.get("consumed", 0))
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count()
        self._groups: dict[str, list[Sample]] = {}
        self._ready: collections.deque[Sample] = collections.deque()
        self._gated_at = self.version  # the version the samples in _groups and _ready were last gated under
        self._requeued: collections.deque[str] = collections.deque()
        self._draining = False
        self._closed = False
        self._cond = threading.Condition()

    # -- admission --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return sum(t.count for t in self._tickets.values())

    @property
    def waiting(self) -> int:
        return len(self.storage) + len(self._ready) + sum(len(g) for g in self._groups.values())

    def capacity(self) -> int:
        """How many more rollouts may start now without breaking the staleness bound."""
        if self.on_stale == "drop":
            return 1 << 62
        limit = (self.version + self.max_staleness + 1) * self.batch_size
        return limit - (self.consumed + self.waiting + self.in_flight)

    def admit(self, count: int = 1, *, prompt_id: str | None = None, timeout: float | None = None) -> Ticket | None:
        """Ask to start ``count`` rollouts; blocks while over capacity (or draining). None on timeout."""
        started = time.perf_counter()
        timeline = recording()
        began = timeline.now()
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._closed or (not (self._draining and self._tickets) and self.capacity() >= count), timeout
            )
            stalled = time.perf_counter() - started
            if stalled > 1e-3:
                self.telemetry.stall(stalled)
                timeline.event("stall", began, began + stalled, count=count,
                               why="draining" if self._draining else "staleness bound", version=self.version)
            if self._closed:
                raise RolloutBufferError("the rollout buffer is closed")
            if not ok:
                return None
            self._draining = False
            ticket = Ticket(next(self._ids), self.version, count, prompt_id)
            ticket.admitted = began + stalled
            self._tickets[ticket.ticket_id] = ticket
            return ticket

    def release(self, ticket: Ticket) -> None:
        """Give a ticket back without putting samples (the rollout failed)."""
        with self._cond:
            self._tickets.pop(ticket.ticket_id, None)
            self._cond.notify_all()

    def next_prompt(self) -> str | None:
        """A prompt whose rollout was aborted by a publish and should be generated again."""
        with self._cond:
            return self._requeued.popleft() if self._requeued else None

    # -- producers --------------------------------------------------------------------------

    def put(self, samples: Sample | Sequence[Sample], ticket: Ticket | None = None) -> bool:
        """Accept finished samples. False if ``ticket`` was aborted by a publish (samples discarded)."""
        batch = [samples] if isinstance(samples, Sample) else list(samples)
        with self._cond:
            if ticket is not None:
                self._tickets.pop(ticket.ticket_id, None)
                if ticket.aborted:
                    self.telemetry.aborted += len(batch)
                    self._cond.notify_all()
                    return False
            if max(s.newest_version for s in batch) > self.version:
                bad = next(s for s in batch if s.newest_version > self.version)
                raise VersionError(f"sample {bad.sample_id} carries version {bad.newest_version}, newer than published {self.version}")
            self.storage.append(batch)
            self.telemetry.put += len(batch)
            self._cond.notify_all()
        self.plugins.hook.rlsync_on_put(samples=batch)
        _record_rollout(ticket, batch)
        return True

    # -- consumers --------------------------------------------------------------------------

    def _decide(self, sample: Sample) -> Decision:
        verdict = self.plugins.hook.rlsync_gate_sample.call_extra(
            self._extra_gates, {"sample": sample, "trainer_version": self.version, "max_staleness": self.max_staleness})
        return Decision.TRAIN if verdict is None else Decision(verdict)

    def _only_builtin_gate(self) -> bool:
        """Whether MaxStaleness is the only gate now (plugins may register after the buffer was built): then _fill
        checks the bound inline, one test per sample taken, instead of a hook call per sample (the hot path)."""
        return not self.gates and [impl.plugin_name for impl in self.plugins.hook.rlsync_gate_sample.get_hookimpls()] \
            == [BUILTIN_GATES]

    def _regate(self) -> None:
        """Ask the gates again about the samples gated under an older version and not handed out yet: a group's
        members can wait in ``_groups`` across publishes (the storage hands samples out oldest version first, so
        members whose first tokens are of different versions, as partial rollouts make them, are taken apart), and a
        group that completed in one ``get`` can wait in ``_ready`` for the next. A member gone stale is dropped; the
        rest of its group goes back to wait for ``group_size`` fresh members (and goes stale in turn if none come)."""
        if self._gated_at == self.version:
            return
        self._gated_at = self.version
        stale = [s for s in itertools.chain(self._ready, *self._groups.values()) if self._decide(s) is Decision.DROP]
        if not stale:
            return
        self._drop(stale)
        gone = {id(s) for s in stale}
        broken = {s.group for s in stale} if self.group_size > 1 else set()
        for name in list(self._groups):
            self._groups[name] = [s for s in self._groups[name] if id(s) not in gone]
            if not self._groups[name]:
                del self._groups[name]
        ready, self._ready = self._ready, collections.deque()
        for s in ready:
            if id(s) in gone:
                continue
            if s.group in broken:
                self._groups.setdefault(s.group, []).append(s)
            else:
                self._ready.append(s)

    def _fill(self, want: int) -> None:
        """Move samples from storage to ``_ready`` through the gates and the group assembly."""
        self._regate()
        while len(self._ready) < want:
            taken = self.storage.take(max(want - len(self._ready), self.group_size))
            if not taken:
                return
            if self.group_size == 1 and self._only_builtin_gate():
                fresh = [s for s in taken if self.version - s.oldest_version <= self.max_staleness]
                self._drop([s for s in taken if self.version - s.oldest_version > self.max_staleness])
                self._ready.extend(fresh)
                continue
            for s in taken:
                if self._decide(s) is Decision.DROP:
                    self._drop([s])
                    continue
                if self.group_size == 1:
                    self._ready.append(s)
                    continue
                group = self._groups.setdefault(s.group, [])
                group.append(s)
                if len(group) >= self.group_size:
                    del self._groups[s.group]
                    kept = freshest_per_group(group, self.group_size)
                    self._drop([g for g in group if all(g is not k for k in kept)])
                    self._ready.extend(kept)

    def _drop(self, samples: Sequence[Sample]) -> None:
        if samples:
            self.telemetry.dropped += len(samples)
            recording().event("drop", samples=len(samples), version=self.version)
            self.storage.ack([s.sample_id for s in samples])  # done with: never handed out again

    def get(self, batch_size: int | None = None, *, max_tokens: int | None = None, timeout: float | None = None) -> Batch | None:
        """The next batch: ``batch_size`` samples (default: the buffer's), or as many whole
        samples as fit in ``max_tokens``. Blocks until it is full; None on timeout."""
        began = recording().now()
        batch = self._get(batch_size, max_tokens, timeout)
        _record_wait(began, batch)
        return batch

    def _get(self, batch_size: int | None, max_tokens: int | None, timeout: float | None) -> Batch | None:
        count = batch_size or self.batch_size
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self.on_stale == "wait" and self._overdue():
                    # A rollout admitted long ago is still running: it must train in this batch or
                    # it will be too stale for the next one, so the trainer waits for it.
                    self._wait(deadline)
                    if self._closed or (deadline is not None and time.monotonic() >= deadline):
                        return None
                    continue
                self._fill(count if max_tokens is None else count + len(self._ready) + 1)
                if max_tokens is not None:
                    taken, tokens = [], 0
                    while self._ready and tokens + self._ready[0].num_tokens <= max_tokens:
                        tokens += self._ready[0].num_tokens
                        taken.append(self._ready.popleft())
                    if taken:
                        break
                    if self._ready:
                        raise RolloutBufferError(f"a sample of {self._ready[0].num_tokens} tokens does not fit max_tokens={max_tokens}")
                elif len(self._ready) >= count:
                    taken = [self._ready.popleft() for _ in range(count)]
                    break
                self._wait(deadline)
                if self._closed or (deadline is not None and time.monotonic() >= deadline):
                    return None
            self.consumed += len(taken)
            self.storage.ack([s.sample_id for s in taken])
            self.storage.save_state({"version": self.version, "consumed": self.consumed})
            batch = Batch(taken, self.version)
            self.telemetry.got += len(taken)
            self.telemetry.record(taken, self.version)
            self._cond.notify_all()
        self.plugins.hook.rlsync_on_get(batch=batch)
        return batch

    def _overdue(self) -> bool:
        return any(t.version <= self.version - self.max_staleness for t in self._tickets.values())

    def _wait(self, deadline: float | None) -> None:
        remaining = 0.05 if deadline is None else min(max(deadline - time.monotonic(), 0.0), 0.05)
        self._cond.wait(remaining)

    def publish(self, version: int) -> None:
        """The trainer now holds ``version``; apply the partial-rollout policy to rollouts in flight."""
        with self._cond:
            if version <= self.version:
                raise VersionError(f"publish({version}): the buffer is already at version {self.version}")
            self.version = version
            if self.partial == "abort":
                for ticket in self._tickets.values():
                    ticket.aborted = True
                    if ticket.prompt_id is not None:
                        self._requeued.append(ticket.prompt_id)
                self._tickets.clear()
            elif self.partial == "drain" and self._tickets:
                self._draining = True
            self.storage.save_state({"version": self.version, "consumed": self.consumed})
            self._cond.notify_all()
        recording().event("publish", version=version)

    def report(self) -> str:
        """A one-line telemetry summary; also handed to ``rlsync_report`` hooks as ``kind="buffer"``."""
        stats = {**self.telemetry.summary(), "version": self.version, "waiting": self.waiting, "in_flight": self.in_flight}
        self.plugins.hook.rlsync_report(kind="buffer", stats=stats)
        return self.telemetry.render()

    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"version": self.version, "consumed": self.consumed}

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.storage.close()

    # -- asyncio ----------------------------------------------------------------------------

    async def aadmit(self, count: int = 1, **kwargs: Any) -> Ticket | None:
        return await asyncio.to_thread(self.admit, count, **kwargs)

    async def aput(self, samples: Sample | Sequence[Sample], ticket: Ticket | None = None) -> bool:
        return await asyncio.to_thread(self.put, samples, ticket)

    async def aget(self, batch_size: int | None = None, **kwargs: Any) -> Batch | None:
        return await asyncio.to_thread(self.get, batch_size, **kwargs)
