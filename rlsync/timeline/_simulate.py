"""``rlsync simulate``: what another setting would buy, predicted by a discrete-event model of the two pools.

What it models:
- **The engine** batches continuously: every step, each sequence in flight gains one token, and the step takes
  ``step_seconds + seq_step_seconds * sequences in flight``; a request (``group`` sequences of one length: the
  measured lengths in the order the run asked for them, or drawn from them at random) ends ``request_overhead``
  after its last token.
- **The rollout buffer** as rlsync's: a ticket is admitted while ``(version + k + 1) * batch`` samples cover
  everything admitted so far; a trainer's batch waits for an admitted ticket that would otherwise go stale.
- **The generators** as examples/async_rl.py runs them: ``lockstep`` and ``one-step-off`` admit whole batches, one at
  a time, all their requests at once; ``async`` admits one prompt's group at a time, from ``prompts * (k + 1)``
  generators.
- **The trainer** takes a batch, trains (``train_seconds + other_seconds``), syncs (``sync_seconds``) and publishes.
  Without partial rollouts a sync first holds new requests and waits for those in flight; with them it pauses the
  requests in flight and they go on with the new weights after it. A pause and a resume are calls to the engine like
  a request's: the pause costs ``request_overhead`` and the step under way, the resume ``request_overhead``.
- **The end** of a run: requests still in flight after the last step finish (the run waits for its generators);
  those admitted but held by the last sync never start.

What it ignores: prefill apart from ``request_overhead``, the KV cache's limit (requests never queue in the engine),
the trainer's step time varying with the batch's tokens, and the network: a sync costs its measured seconds, or what
``rlsync plan`` predicts when given. Costs come from a recorded timeline (``fit_costs``; a lockstep run sees each
cost alone) or from flags.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from dataclasses import dataclass, field
from typing import Any

from rlsync.core import ConfigError

MODES = ("lockstep", "one-step-off", "async", "async-partial")


@dataclass
class Costs:
    """What the model needs to know of the machine and the task (seconds; lengths in tokens per sequence)."""

    step_seconds: float
    seq_step_seconds: float
    request_overhead: float
    train_seconds: float
    sync_seconds: float
    lengths: list[int]
    group: int
    prompts: int
    other_seconds: float = 0.0


def fit_costs(events: list[dict[str, Any]]) -> Costs:
    """The costs of a recorded run: the engine's step costs by least squares over its requests (each request's
    seconds against its length and the sequences in flight beside it), the trainer's mean step and sync, the lengths
    and the batch shape. Requests need ``tokens`` and ``sequences`` (``rlsync.timeline.span("request", ...)``)."""
    import numpy as np

    requests = sorted((e for e in events if e["kind"] == "request" and "end" in e and e.get("sequences")
                       and e.get("tokens")), key=lambda e: e["start"])  # the lengths in the order the run asked them
    if len(requests) < 3:
        raise ConfigError(f"the timeline has {len(requests)} request spans with tokens and sequences: the engine's costs "
                          "need at least 3 (record each generation request with rlsync.timeline.span('request', "
                          "sequences=N) and set its tokens)")
    edges = sorted({t for r in requests for t in (r["start"], r["end"])})
    at = {t: i for i, t in enumerate(edges)}
    change = np.zeros(len(edges))
    for r in requests:
        change[at[r["start"]]] += r["sequences"]
        change[at[r["end"]]] -= r["sequences"]
    active = np.cumsum(change)[:-1]  # sequences in flight from edges[i] to edges[i + 1]
    in_flight = np.concatenate([[0.0], np.cumsum(active * np.diff(edges))])  # their sequence-seconds up to edges[i]
    rows, seconds = [], []
    for r in requests:
        lo, hi = at[r["start"]], at[r["end"]]
        span = r["end"] - r["start"]
        beside = float(in_flight[hi] - in_flight[lo]) / span if span > 0 else r["sequences"]
        length = r["tokens"] / r["sequences"]
        rows.append([1.0, length, length * beside])
        seconds.append(span)
    a, b = np.asarray(rows), np.asarray(seconds)
    coef = np.linalg.lstsq(a, b, rcond=None)[0]
    for column in np.argsort(coef):  # a negative cost is noise: fit again without it
        if coef[column] >= 0:
            break
        a[:, column] = 0.0
        coef = np.linalg.lstsq(a, b, rcond=None)[0]
    coef = np.clip(coef, 0.0, None)
    trains = [e["end"] - e["start"] for e in events if e["kind"] == "train" and "end" in e]
    syncs = [e["end"] - e["start"] for e in events if e["kind"] == "sync" and "end" in e and "route" in e] or \
            [e["end"] - e["start"] for e in events if e["kind"] == "sync" and "end" in e]
    batches = [e for e in events if e["kind"] == "wait_batch" and "samples" in e]
    if not trains or not syncs or not batches:
        raise ConfigError("the timeline needs the trainer's steps (rlsync.timeline.span('train')), its batches (the "
                          "rollout buffer's get) and its syncs (a WeightsWriter or VllmServer) to fit the trainer's costs")
    group = round(statistics.median(r["sequences"] for r in requests))
    batch = round(statistics.median(e["samples"] for e in batches))
    runs = [e for e in events if e["kind"] == "run" and "end" in e]
    other = 0.0
    if runs:  # what the trainer does besides training, syncing and waiting for a batch, per step (rewards, say)
        waits = sum(e["end"] - e["start"] for e in batches)
        rest = (runs[0]["end"] - runs[0]["start"]) - sum(trains) - sum(syncs) - waits
        other = max(0.0, rest / len(trains)) if _lockstep(events) else 0.0
    return Costs(step_seconds=float(coef[1]), seq_step_seconds=float(coef[2]), request_overhead=float(coef[0]),
                 train_seconds=statistics.mean(trains), sync_seconds=statistics.mean(syncs),
                 lengths=[round(r["tokens"] / r["sequences"]) for r in requests], group=group,
                 prompts=max(1, batch // group), other_seconds=other)


def _lockstep(events: list[dict[str, Any]]) -> bool:
    """Whether every batch was trained on its own version only (then the rest of the trainer's time is its own)."""
    return all(set(e["lags"]) <= {"0"} for e in events if e["kind"] == "wait_batch" and "lags" in e)


@dataclass
class _Request:
    length: int
    group: int
    ticket: _Ticket
    made: int = 0
    versions: dict[int, int] = field(default_factory=dict)  # version -> tokens per sequence made under it


@dataclass
class _Ticket:
    size: int
    version: int
    requests: list[_Request] = field(default_factory=list)
    done: int = 0


def simulate(costs: Costs, mode: str, steps: int, *, max_staleness: int = 1, seed: int | None = 0) -> dict[str, Any]:
    """One run of ``steps`` optimizer steps in ``mode`` (``MODES``): samples/s, each pool's idle shares, the staleness
    of the tokens trained on. Each request's length is drawn from ``costs.lengths`` (``seed``), or with ``seed=None``
    taken in their order, again from the first when they run out (the recorded run's own sequence of tasks)."""
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r}: one of {', '.join(MODES)}")
    return _Run(costs, mode, steps, max_staleness, seed).go()


class _Run:
    def __init__(self, costs: Costs, mode: str, steps: int, max_staleness: int, seed: int | None) -> None:
        self.c = costs
        self.k = 0 if mode == "lockstep" else 1 if mode == "one-step-off" else max_staleness
        self.partial = mode == "async-partial"
        self.whole_batches = mode in ("lockstep", "one-step-off")
        self.batch = costs.prompts * costs.group
        self.steps = steps
        rng = random.Random(seed)
        drawn = (rng.choice(costs.lengths) for _ in itertools.count())
        self.lengths = itertools.cycle(costs.lengths) if seed is None else drawn
        self.t = 0.0
        self.version = 0
        self.consumed = self.waiting = self.in_flight = 0
        self.ready: list[tuple[int, int, dict[int, int], int]] = []  # (oldest version, order, versions, group) groups put
        self.order = itertools.count()
        self.tickets: list[_Ticket] = []
        self.running: list[_Request] = []  # requests in the engine
        self.held: list[_Request] = []  # admitted, waiting for a sync to end
        self.finishing: list[tuple[float, int, _Request]] = []  # last token made, overhead to go
        self.generators = 1 if self.whole_batches else costs.prompts * (self.k + 1)
        self.idle_generators = self.generators
        self.trainer = "get"
        self.trainer_until = 0.0
        self.syncing = False
        self.done_steps = 0
        self.step_end: float | None = None
        self.seconds = {"generation": {"busy": 0.0, "sync": 0.0, "waiting for the trainer": 0.0},
                        "training": {"busy": 0.0, "sync": 0.0, "waiting for a batch": 0.0, "waiting for stragglers": 0.0}}
        self.lags: dict[int, int] = {}

    # -- the buffer and the generators ------------------------------------------------------

    def _admit(self) -> None:
        size = self.batch if self.whole_batches else self.c.group
        while self.idle_generators and (self.version + self.k + 1) * self.batch - (
                self.consumed + self.waiting + self.in_flight) >= size:
            self.idle_generators -= 1
            self.in_flight += size
            ticket = _Ticket(size, self.version)
            for _ in range(size // self.c.group):
                request = _Request(next(self.lengths), self.c.group, ticket)
                ticket.requests.append(request)
                (self.held if self.syncing and not self.partial else self.running).append(request)
            self.tickets.append(ticket)

    def _finish(self, request: _Request) -> None:
        ticket = request.ticket
        ticket.done += 1
        if ticket.done < len(ticket.requests):
            return
        self.tickets.remove(ticket)
        self.in_flight -= ticket.size
        self.waiting += ticket.size
        for r in ticket.requests:
            heapq.heappush(self.ready, (min(r.versions), next(self.order), r.versions, r.group))
        self.idle_generators += 1

    # -- the trainer ------------------------------------------------------------------------

    def _trainer(self) -> None:
        if self.trainer == "get" and self.waiting >= self.batch and not any(
                t.version <= self.version - self.k for t in self.tickets):
            taken = 0
            while taken < self.batch:
                _, _, versions, group = heapq.heappop(self.ready)
                for v, tokens in versions.items():
                    self.lags[self.version - v] = self.lags.get(self.version - v, 0) + tokens * group
                taken += group
            self.waiting -= taken
            self.consumed += taken
            self.trainer, self.trainer_until = "train", self.t + self.c.train_seconds + self.c.other_seconds
        elif self.trainer == "train" and self.t >= self.trainer_until:
            self.syncing = True  # no request starts; with partial rollouts, those in flight stop after this step
            self.trainer = "pause" if self.partial else "drain"
            self.trainer_until = self.t + self.c.request_overhead + self.c.step_seconds
        if self.trainer == "pause" and self.t >= self.trainer_until:
            self.trainer, self.trainer_until = "sync", self.t + self.c.sync_seconds + self.c.request_overhead
        if self.trainer == "drain" and not self.running and not self.finishing:
            self.trainer, self.trainer_until = "sync", self.t + self.c.sync_seconds
        if self.trainer == "sync" and self.t >= self.trainer_until and (self.partial or self.step_end is None):
            self.version += 1
            self.done_steps += 1
            self.syncing = False
            self.running.extend(self.held)
            self.held.clear()
            self.trainer = "get"

    # -- the engine -------------------------------------------------------------------------

    def _engine_runs(self) -> bool:
        return bool(self.running) and not (self.syncing and self.partial)

    def _step_done(self) -> None:
        self.step_end = None
        for request in list(self.running):
            request.made += 1
            request.versions[self.version] = request.versions.get(self.version, 0) + 1
            if request.made >= request.length:
                self.running.remove(request)
                heapq.heappush(self.finishing, (self.t + self.c.request_overhead, next(self.order), request))

    def _account(self, until: float) -> None:
        span = until - self.t
        if span <= 0:
            return
        gen = self.seconds["generation"]
        if (self.running and not (self.syncing and self.partial)) or self.finishing:
            gen["busy"] += span
        elif self.syncing:
            gen["sync"] += span
        else:
            gen["waiting for the trainer"] += span
        train = self.seconds["training"]
        train[{"get": "waiting for a batch", "train": "busy", "drain": "waiting for stragglers",
               "pause": "waiting for stragglers", "sync": "sync"}[self.trainer]] += span

    def go(self) -> dict[str, Any]:
        while True:
            self._trainer()
            if self.done_steps < self.steps:
                self._admit()
                self._trainer()
            if self.done_steps >= self.steps:
                break  # the run ends with its last version's sync: what is still in flight then is never trained on
            if self.step_end is None and self._engine_runs():
                sequences = sum(r.group for r in self.running)
                self.step_end = self.t + self.c.step_seconds + self.c.seq_step_seconds * sequences
            times = [x for x in (self.step_end, self.finishing[0][0] if self.finishing else None,
                                 self.trainer_until if self.trainer in ("train", "pause", "sync") else None) if x is not None]
            if not times:
                raise RuntimeError(f"the model is stuck at t={self.t:.3f} s (trainer {self.trainer}, {self.waiting} "
                                   f"samples waiting, {self.in_flight} in flight): a bug of the simulator")
            now = max(self.t, min(times))
            self._account(now)
            self.t = now
            if self.step_end is not None and self.t >= self.step_end:
                self._step_done()
            while self.finishing and self.finishing[0][0] <= self.t:
                self._finish(heapq.heappop(self.finishing)[2])
        wall = self.t
        total = sum(self.lags.values())
        return {"samples_per_second": self.steps * self.batch / wall, "wall_seconds": wall,
                "idle": {pool: {why: s / wall for why, s in reasons.items() if why != "busy"}
                         for pool, reasons in self.seconds.items()},
                "staleness": {str(k): v / total for k, v in sorted(self.lags.items())} if total else {}}


def predict(costs: Costs, modes: list[str], steps: int, *, max_staleness: int = 1, repeats: int = 20,
            replay: bool = False) -> dict[str, Any]:
    """Each mode's figures, the mean of ``repeats`` runs with other draws of the lengths; with ``replay``, of one run
    that takes the lengths in their recorded order."""
    out: dict[str, Any] = {}
    seeds: list[int | None] = [None] if replay else list(range(repeats))
    for mode in modes:
        runs = [simulate(costs, mode, steps, max_staleness=max_staleness, seed=seed) for seed in seeds]
        out[mode] = {"samples_per_second": statistics.mean(r["samples_per_second"] for r in runs),
                     "idle": {pool: {why: statistics.mean(r["idle"][pool][why] for r in runs) for why in reasons}
                              for pool, reasons in runs[0]["idle"].items()},
                     "staleness": {k: statistics.mean(r["staleness"].get(k, 0.0) for r in runs)
                                   for k in sorted({k for r in runs for k in r["staleness"]}, key=int)}}
    return out
