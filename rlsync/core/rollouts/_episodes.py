"""Episodes that outlive their generator: a multi-turn rollout recorded step by step, resumed by another
generator when its lease runs out, its tool calls never run twice, its sample delivered exactly once.

A generator ``claim``s an episode (a new one, or one whose generator stopped renewing its lease) and runs
its agent loop through the ``Episode``: every model turn (``turn``) and every tool call (``tool``) is a
numbered step. A step already in the log is not run again: ``turn`` returns the recorded tokens (the engine
re-reads them as the next turn's prefix), ``tool`` the recorded result. A step not yet in the log runs and is
recorded before the loop goes on. So a resumed episode replays its log, then continues where the dead
generator stopped; with greedy decoding it ends with the tokens an uninterrupted run has.

A tool call is recorded twice: as started (its name and arguments) before it runs, and with its result
after. A call that was started and never finished (its generator died during it) runs again on resume, with
the same ``key`` (``"<episode>/<step>"``): the one thing a tool author must make idempotent anyway.

Every claim bumps the episode's epoch; a record or finish under an older epoch (a generator that was
thought dead and came back) raises ``LeaseLostError`` and changes nothing. ``finish`` marks the episode
done and adds its sample (``sample_id`` = the episode's id) in one atomic step of the storage.

Generators either take whatever episode waits (``Episode.next``: a pool of generators over one log) or run the
episodes a framework hands them, by a stable id (``Episode.claim``: verl's agent loop, where a restarted worker is
handed the same trajectories again); an episode whose sample the framework delivers itself finishes without one,
and keeps its steps: a claim by id of it later (the framework re-runs the trajectory after a restart) replays every
step and records nothing.

The log is an ``EpisodeLog`` (the contract; ``rlsync.testing.check_episode_log`` checks one):
``MemoryEpisodes`` (threads of one process, finishing into a ``RolloutBuffer``), ``RedisEpisodes``
(processes on any host, durable, finishing into the ``RedisStorage`` of the same name) and the Ray buffer's.
Entries are msgpack (never pickle).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from rlsync.core._errors import LeaseLostError, RolloutBufferError
from rlsync.core.rollouts._samples import Sample


class Claim(msgspec.Struct, frozen=True):
    """An episode handed to a generator: its ``prompt`` (what ``EpisodeLog.add`` got), the ``epoch`` its records
    must carry, and the ``steps`` recorded so far (msgpack entries, in order). ``done``: only from a claim by id of
    an episode that was finished already (its steps, if it finished without a sample; nothing more is recorded)."""

    episode_id: str
    epoch: int
    prompt: bytes
    steps: list[bytes]
    done: bool = False


class Turn(msgspec.Struct, frozen=True):
    """One model turn: the tokens generated, and per token the policy version that sampled it, its log-prob,
    and (where recorded) its sampling mask's kept-set size. ``extra``: what else the engine answered that the agent
    loop reads again on replay (msgpack types: verl's stop reason and extra fields, for example)."""

    tokens: list[int]
    versions: list[int]
    logprobs: list[float]
    kept: list[int] = []
    extra: dict[str, Any] = {}


class _Step(msgspec.Struct, frozen=True, tag=True):
    pass


class _TurnStep(_Step, frozen=True, tag="turn"):
    turn: Turn


class _ToolStarted(_Step, frozen=True, tag="started"):
    name: str
    arguments: Any


class _ToolDone(_Step, frozen=True, tag="done"):
    result: Any


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_TurnStep | _ToolStarted | _ToolDone).decode


@runtime_checkable
class EpisodeLog(Protocol):
    """Where episodes in flight are recorded; see the module docstring. Every method is atomic.

    ``add`` (a new episode, once per id: False when the id is known), ``claim`` (hand an unclaimed episode, or
    one whose lease ran out, to ``owner`` until ``lease_seconds`` from now, under a new epoch; None when there is
    none; with ``episode_id``, that episode only: None when it is unknown or leased, a ``done`` claim when it was
    finished, with its steps if it finished without a sample), ``record`` (append entry number ``step`` under
    ``epoch`` and renew the lease; recording a step again with the same entry is a no-op, anything else
    ``ValueError``; a stale epoch or a finished episode: ``LeaseLostError``), ``finish`` (mark it done and add
    ``sample``, its ``sample_id`` set to the episode's, to the samples, once: True; False when it was already
    finished; ``LeaseLostError`` under a stale epoch; a ``sample`` of None delivers nothing and keeps the steps, for a
    while the log decides), ``unfinished`` (episodes added and not finished), ``close``."""

    def add(self, episode_id: str, prompt: bytes) -> bool: ...
    def claim(self, owner: str, lease_seconds: float, episode_id: str | None = None) -> Claim | None: ...
    def record(self, episode_id: str, epoch: int, step: int, entry: bytes, lease_seconds: float) -> None: ...
    def finish(self, episode_id: str, epoch: int, sample: Sample | None) -> bool: ...
    def unfinished(self) -> int: ...
    def close(self) -> None: ...


class Episode:
    """A claimed episode, run by one generator; see the module docstring. ``Episode.next(log, owner)`` claims the
    next one, ``Episode.claim(log, episode_id, prompt, owner)`` a given one.

    ``recorded``: how many steps were recorded before this claim (another generator started the episode: it is
    ``resumed``); ``replayed``: how many of them were returned from the log instead of run, so far; ``finished``: a
    claim by id of an episode finished before (its recorded steps replay; a step beyond them raises, nothing more is
    recorded; ``finish`` says False).
    ``turn_async`` and ``tool_async`` are ``turn`` and ``tool`` for an asyncio agent loop.
    """

    def __init__(self, log: EpisodeLog, claim: Claim, lease_seconds: float) -> None:
        self._log = log
        self.episode_id = claim.episode_id
        self.epoch = claim.epoch
        self.prompt = claim.prompt
        self.finished = claim.done
        try:
            self._steps = [_decode(entry) for entry in claim.steps]
        except msgspec.MsgspecError as exc:  # the log holds steps no rlsync Episode recorded: named, not replayed
            raise RolloutBufferError(f"episode {claim.episode_id}: a recorded step is not an rlsync step ({exc})") from None
        self.recorded = len(self._steps)
        self._at = 0  # the next step number
        self._lease_seconds = lease_seconds
        self.turns: list[Turn] = []  # this episode's model turns so far, recorded or replayed

    @property
    def resumed(self) -> bool:
        return self.recorded > 0

    @property
    def replayed(self) -> int:
        return min(self._at, self.recorded)

    @classmethod
    def next(cls, log: EpisodeLog, owner: str, *, lease_seconds: float = 60.0) -> Episode | None:
        """Claim the next episode (one whose generator died first, else a new one); None when none waits.
        ``lease_seconds``: how long it stays this generator's without a record (``renew`` in longer turns)."""
        claim = log.claim(owner, lease_seconds)
        return None if claim is None else cls(log, claim, lease_seconds)

    @classmethod
    def claim(cls, log: EpisodeLog, episode_id: str, prompt: bytes, owner: str, *,
              lease_seconds: float = 60.0) -> Episode | None:
        """Claim episode ``episode_id`` (added with ``prompt`` if the log does not know it yet): None while another
        generator holds its lease; a ``finished`` Episode (replaying what it recorded) when it was finished before."""
        log.add(episode_id, prompt)
        claim = log.claim(owner, lease_seconds, episode_id)
        if claim is not None and claim.prompt != bytes(prompt):
            raise RolloutBufferError(f"episode {episode_id}: recorded for another prompt than this one; an episode id must "
                                     "name one prompt (and one sample of it)")
        return None if claim is None else cls(log, claim, lease_seconds)

    @classmethod
    async def claim_when_free(cls, log: EpisodeLog, episode_id: str, prompt: bytes, owner: str, *,
                              lease_seconds: float = 60.0) -> Episode:
        """``claim`` in an asyncio loop, waiting while another generator holds the episode's lease (it is alive, or
        died less than a lease ago)."""
        while True:
            episode = cls.claim(log, episode_id, prompt, owner, lease_seconds=lease_seconds)
            if episode is not None:
                return episode
            await asyncio.sleep(min(1.0, lease_seconds / 4))

    async def keep_lease(self) -> None:
        """Renew the lease every third of it until cancelled (an asyncio task beside the agent loop: a model turn or a
        tool call may take longer than the lease); ends when another generator took the episode (its next record
        raises ``LeaseLostError``)."""
        while True:
            await asyncio.sleep(self._lease_seconds / 3)
            try:
                self.renew()
            except LeaseLostError:
                return

    def turn(self, generate: Callable[[], Turn]) -> Turn:
        """The next model turn: the recorded one, or ``generate()``'s, recorded before it is returned."""
        recorded = self._replay(_TurnStep)
        return self._turned(recorded.turn if recorded is not None else generate(), recorded is None)

    async def turn_async(self, generate: Callable[[], Awaitable[Turn]]) -> Turn:
        """``turn`` with a coroutine function."""
        recorded = self._replay(_TurnStep)
        return self._turned(recorded.turn if recorded is not None else await generate(), recorded is None)

    def tool(self, name: str, call: Callable[[str], Any], arguments: Any = None) -> Any:
        """The result of the next tool call: the recorded one (``call`` is not run), or ``call(key)``'s, recorded
        before it is returned. ``key`` (``"<episode>/<step>"``) is the same when a call that was in flight when its
        generator died runs again on resume: a tool with side effects dedupes on it. Results and ``arguments`` are
        anything msgpack holds (str, numbers, lists, dicts, bytes)."""
        key, done = self._tool_started(name, arguments)
        if done is not None:
            return done.result
        return self._tool_done(call(key))

    async def tool_async(self, name: str, call: Callable[[str], Awaitable[Any]], arguments: Any = None) -> Any:
        """``tool`` with a coroutine function."""
        key, done = self._tool_started(name, arguments)
        if done is not None:
            return done.result
        return self._tool_done(await call(key))

    def renew(self) -> None:
        """Keep the lease during a long step (a record renews it too)."""
        self._log.record(self.episode_id, self.epoch, -1, b"", self._lease_seconds)

    def finish(self, sample: Sample | None) -> bool:
        """Deliver the episode's ``sample`` (the log gives it the episode's id), exactly once over every generator that
        ran it: True, or False when it was finished already. None: the episode ends and nothing is delivered (a
        framework that takes the sample from the agent loop itself)."""
        if self._at < len(self._steps):
            raise RolloutBufferError(f"episode {self.episode_id}: finished after step {self._at} of the {len(self._steps)} "
                                     f"recorded: the agent loop must replay every recorded step before it finishes")
        if self.finished:
            return False
        return self._log.finish(self.episode_id, self.epoch, sample)

    def _turned(self, turn: Turn, generated: bool) -> Turn:
        if generated:
            self._record(_TurnStep(turn))
        self.turns.append(turn)
        return turn

    def _tool_started(self, name: str, arguments: Any) -> tuple[str, _ToolDone | None]:
        """The call's key and, when its result was recorded, that; records its start when it was not."""
        started = self._replay(_ToolStarted)
        if started is not None and started.name != name:
            raise RolloutBufferError(f"episode {self.episode_id}: step {self._at - 1} recorded a call of tool {started.name!r}, "
                                     f"the agent now calls {name!r}: the agent loop must make the same calls on resume")
        key = f"{self.episode_id}/{self._at - 1 if started is not None else self._at}"
        if started is None:
            self._record(_ToolStarted(name, arguments))
        return key, self._replay(_ToolDone)

    def _tool_done(self, result: Any) -> Any:
        self._record(_ToolDone(result))
        return result

    def _replay(self, kind: type[Any]) -> Any:
        if self._at >= len(self._steps):
            return None
        step = self._steps[self._at]
        if not isinstance(step, kind):
            raise RolloutBufferError(f"episode {self.episode_id}: step {self._at} was recorded as {type(step).__name__}, "
                                     f"the agent now asks for {kind.__name__}: the agent loop must take the same steps on resume")
        self._at += 1
        return step

    def _record(self, step: _Step) -> None:
        if self.finished:
            raise RolloutBufferError(f"episode {self.episode_id} was finished before this claim, after {self.recorded} "
                                     "steps: the agent loop asks for one more (it must take the same steps on a replay)")
        self._log.record(self.episode_id, self.epoch, self._at, _encode(step), self._lease_seconds)
        self._steps.append(step)
        self._at += 1


class _Entry:
    __slots__ = ("deadline", "done", "epoch", "prompt", "steps")

    def __init__(self, prompt: bytes) -> None:
        self.prompt = prompt
        self.epoch = 0
        self.deadline = 0.0  # claimable from then on (0: never claimed)
        self.done = False
        self.steps: list[bytes] = []


class MemoryEpisodes:
    """The embedded ``EpisodeLog``: generator threads of the process that holds ``put`` (a ``RolloutBuffer``'s, or
    any callable that takes a list of samples). Survives the death of a generator thread's work, not of the
    process (``RedisEpisodes`` for that)."""

    def __init__(self, put: Callable[[Sequence[Sample]], Any] | Any) -> None:
        self._put = put.put if hasattr(put, "put") else put
        self._episodes: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def add(self, episode_id: str, prompt: bytes) -> bool:
        with self._lock:
            if episode_id in self._episodes:
                return False
            self._episodes[episode_id] = _Entry(bytes(prompt))
            return True

    def claim(self, owner: str, lease_seconds: float, episode_id: str | None = None) -> Claim | None:
        now = time.monotonic()
        with self._lock:
            if episode_id is not None:
                entry = self._episodes.get(episode_id)
                if entry is None or entry.deadline > now:
                    return None
                if entry.done:
                    return Claim(episode_id, entry.epoch, entry.prompt, list(entry.steps), done=True)
            else:
                waiting = [(e.deadline > 0, e.deadline, i) for i, e in self._episodes.items() if not e.done and e.deadline <= now]
                if not waiting:
                    return None
                # a resumable one first (its work is older), then new ones in the order added
                _, _, episode_id = min(waiting, key=lambda w: (not w[0], w[1]))
                entry = self._episodes[episode_id]
            entry.epoch += 1
            entry.deadline = now + lease_seconds
            return Claim(episode_id, entry.epoch, entry.prompt, list(entry.steps))

    def record(self, episode_id: str, epoch: int, step: int, entry: bytes, lease_seconds: float) -> None:
        with self._lock:
            held = self._held(episode_id, epoch)
            if step >= 0:
                _append_step(held.steps, episode_id, step, entry)
            held.deadline = time.monotonic() + lease_seconds

    def finish(self, episode_id: str, epoch: int, sample: Sample | None) -> bool:
        with self._lock:
            known = self._episodes.get(episode_id)
            if known is not None and known.done:
                return False
            held = self._held(episode_id, epoch)
            if sample is not None:
                sample.sample_id = episode_id
                self._put([sample])  # under the lock: a second finish waits, then sees done
                held.steps = []  # no sample: kept for a replay (for the life of this process)
            held.done, held.deadline = True, 0.0
            return True

    def _held(self, episode_id: str, epoch: int) -> _Entry:
        entry = self._episodes.get(episode_id)
        if entry is None:
            raise RolloutBufferError(f"no episode {episode_id!r} was added")
        if entry.epoch != epoch or entry.done:
            raise LeaseLostError(f"episode {episode_id}: {'finished' if entry.done else f'claimed again (epoch {entry.epoch})'}"
                                 f", this generator's epoch {epoch} is void")
        return entry

    def unfinished(self) -> int:
        with self._lock:
            return sum(not e.done for e in self._episodes.values())

    def close(self) -> None:
        pass


def _append_step(steps: list[bytes], episode_id: str, step: int, entry: bytes) -> None:
    """Step ``step`` into ``steps``: the next one, or a retry of a recorded one with the same entry."""
    if step == len(steps):
        steps.append(entry)
    elif step > len(steps) or steps[step] != entry:
        raise ValueError(f"episode {episode_id}: step {step} does not follow the {len(steps)} recorded")
