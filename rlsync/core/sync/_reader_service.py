"""A reader's service thread: what comes in on its control socket is decoded, authenticated, dispatched or refused.

``ReaderService`` is one part of ``WeightsReader`` (its other part, ``VersionLanding``, keeps the version state): sessions
opened by a Knock, the writers' Hellos and layout requests, restarts of writer ranks, and the rejection of what no
honest writer sends (counted and logged, never read by a waiting engine)."""

from __future__ import annotations

import bisect
import logging
import os
import secrets
import time
from collections.abc import Iterable
from functools import partial
from collections.abc import Mapping
from typing import TypeVar

from rlsync.core.layouts import replicated
from rlsync.core.sync._checksum import for_memory
from rlsync.core.sync._control import (
    AskLayout,
    BadFrame,
    Begin,
    Done,
    Hello,
    Knock,
    LayoutIs,
    Refuse,
    Session,
    Welcome,
)
from rlsync.core.sync._reader_state import ReaderState
from rlsync.core._errors import ConfigError, RlsyncError
from rlsync.core.layouts import Layout

from rlsync.core.sync._control import MAX_SESSIONS

REJECTIONS_LOGGED_EVERY = 10.0  # seconds between log lines about rejected messages (a stream of them is counted)
_log = logging.getLogger("rlsync")
K = TypeVar("K")
V = TypeVar("V")


class ReaderService(ReaderState):
    def _serve(self) -> None:
        while not self._closed.is_set():
            if self._landing is not None:
                self._landing.progress()
            if self._paused_at is not None and time.monotonic() - self._paused_at > self.options.timeout:
                self._undo(f"version {self._pending_version} did not complete within {self.options.timeout} s (a writer died?)")
            for _ in range(self._channel.failed_handshakes()):  # a peer without the key: counted, nothing else
                self._reject(None, "a peer failed the control socket's handshake: the peers' keys differ (another "
                                   "secret, an address without its #KEY, or a stranger)")
            for closed in self._channel.lost_peers():
                self._connection_closed(closed)
            try:
                got = self._channel.recv(timeout_ms=20)
            except BadFrame as exc:  # a wrong key or a hostile frame: refused, and the reader goes on
                self._reject(exc.identity, f"{exc}")
                continue
            if got is None:
                continue
            identity, msg, session = got
            assert identity is not None  # ROUTER sockets always prefix the sender's identity
            try:
                self._handle(identity, msg, session)
            except Exception as exc:  # noqa: BLE001 - no message stops the service thread: this one is refused
                if self._may_log():  # a traceback per message would be a log of the peer's choosing: one per period
                    _log.exception("reader rank %d: handling a %s failed", self.rank, type(msg).__name__)
                self._reject(identity, f"reader rank {self.rank} could not handle a {type(msg).__name__}: {exc!r}")
        if self._paused_at is not None:  # closed in the middle of an in-place version: the engine gets its last one back
            self._undo("the reader closed")

    def _handle(self, identity: bytes, msg: object, session: Session | None) -> None:
        if isinstance(msg, Knock):
            self._knocked(identity, msg)
        elif isinstance(msg, (Hello, AskLayout)) and not self._opens(session):
            self._reject(identity, f"a {type(msg).__name__} that is not the first message of a session a Knock opened")
        elif isinstance(msg, Hello):
            assert session is not None
            self._hello(identity, msg, session)
        elif isinstance(msg, AskLayout):
            self._layout_asked(identity, msg)
        elif isinstance(msg, (Begin, Done)):
            if not self._in_session(identity, msg, session):
                return
            if isinstance(msg, Begin):
                self._begin(identity, msg)
            else:
                self._finish_part(identity, msg)
        else:
            self._reject(identity, f"a {type(msg).__name__} is not for a reader")

    def _reject(self, identity: bytes | None, reason: str) -> None:
        """A message no honest writer sends: counted, logged (one line per ``REJECTIONS_LOGGED_EVERY`` seconds at
        most), answered (the peer may be a misconfigured writer that needs the reason: in its session, or unsigned
        and rate-limited to a peer without one), and the reader goes on. Nothing else changes: an engine's wait
        reads none of it, so a stranger that can reach the port cannot stop a rollout."""
        reason = bounded(reason)
        self._count_rejection(reason, "rejected %d control message(s)")
        if identity is not None:
            try:
                self._channel.send(Refuse(reason), identity)
            except Exception:  # noqa: BLE001 - a peer that cannot be answered is left alone
                pass

    def _count_rejection(self, reason: str, what: str) -> None:
        """One more rejection, counted (``rejected``, ``last_rejection``) and logged one line per
        ``REJECTIONS_LOGGED_EVERY`` seconds at most, whoever sends them and however many."""
        self.rejected += 1
        self.last_rejection = reason
        self._unlogged += 1
        if self._may_log():
            _log.warning("reader rank %d " + what + " since the last line (all are counted in WeightsReader.rejected), "
                         "the last: %s", self.rank, self._unlogged, reason)
            self._unlogged = 0

    def _may_log(self) -> bool:
        """Whether a line about a peer's message may be logged now (one per ``REJECTIONS_LOGGED_EVERY`` seconds)."""
        now = time.monotonic()
        if now - self._logged_at < REJECTIONS_LOGGED_EVERY:
            return False
        self._logged_at = now
        return True

    def _in_session(self, identity: bytes, msg: Begin | Done, session: Session | None) -> bool:
        """Whether ``msg`` comes in the session this reader welcomed for its writer rank; a new session of a rank
        (a writer that reconnected or restarted) becomes its rank's session here, with its first Begin or Done."""
        welcomed = None if session is None else self._welcomed.get(session.id)
        if session is None or welcomed is None or welcomed[0] != msg.writer_rank:
            self._reject(identity, f"a {type(msg).__name__} for writer rank {msg.writer_rank} outside the session this "
                                   f"reader opened for that rank (send a Hello first)")
            return False
        if self._active.get(msg.writer_rank) != session.id:
            self._activate(msg.writer_rank, welcomed[1])
            self._active[msg.writer_rank] = session.id
        return True

    def _connection_closed(self, identity: bytes) -> None:
        """A peer's control connection closed. Where it was the session of a writer rank that has not finished its
        part of the version landing now (and has not said Hello again: a reconnecting writer starts its part over in a
        new session), that part will not come: the version is given up now, not at the timeout. A version is landing
        from the first writer's Begin (every writer asks before its first byte), so a lone trainer rank that dies
        mid-version is found too."""
        rank = next((r for r, sid in self._active.items()
                     if (s := self._channel.sessions.get(sid)) is not None and s.peer == identity), None)
        version = self._pending_version
        if rank is None or version is None or rank in self._done or rank not in self._expected or self._hellos.get(rank):
            return
        del self._active[rank]
        self._lost_part(f"writer rank {rank}'s connection closed before it finished version {version} (did the trainer "
                        f"die?): the version is dropped, version {self._version} stays live")

    def _replicate(self, src: Layout | None) -> None:
        """A replica reader (``dst=None, replicas=N``) holds a whole copy of the writers' tensors."""
        if self.dst is None and src is not None and self.replicas is not None:
            check_peer_layout(src)
            self._set_dst(replicated(src.tensors, tuple(range(self.replicas))))  # its room checked first
            self._adopt(src)

    def _layout_asked(self, identity: bytes, msg: AskLayout) -> None:
        self._replicate(msg.src)
        if self.dst is None:
            self._channel.send(Refuse(f"reader rank {self.rank} learns its layout from the writers: ask with yours"), identity)
            return
        self._channel.send(LayoutIs(self.dst, self._version), identity)

    def _opens(self, session: Session | None) -> bool:
        """Whether ``session`` was just opened by a Knock and has not spoken: it may say one Hello or AskLayout."""
        if session is None or session.id not in self._fresh:
            return False
        del self._fresh[session.id]
        return True

    def _knocked(self, identity: bytes, knock: Knock) -> None:
        """A writer opens a session: a fresh nonce (one seen before was recorded: refused) is answered with the
        reader's ``Challenge``; the session may then say one Hello or AskLayout."""
        if len(knock.nonce) < 16 or knock.nonce in self._nonces:
            self._reject(identity, "a Knock without a fresh nonce (replayed, or from an older rlsync): refused")
            return
        _keep_newest(self._nonces, knock.nonce, None)
        session = self._channel.answer_knock(identity, knock, needs_src=self.plan is None, max_bytes=self._bound,
                                             rank=knock.rank)
        _keep_newest(self._fresh, session.id, None)

    def _hello(self, identity: bytes, msg: Hello, session: Session) -> None:
        if session.rank is not None and msg.writer_rank != session.rank:  # one rank's credential speaks for it alone
            self._reject(identity, f"a Hello for writer rank {msg.writer_rank} in a session of writer rank "
                                   f"{session.rank}'s own credential: refused")
            return
        self._replicate(msg.src)
        if self.dst is not None and msg.dst_fingerprint != self._dst_fingerprint:
            self._refuse_writer(identity, f"the writer was built for another destination layout than reader rank {self.rank} "
                                          f"holds ({_first_difference(msg.dst_tensors, self._dst_tensors)}): build the "
                                          f"WeightsWriter with dst=None, and it learns the engine's layout from its readers")
            return
        if self.plan is None and msg.src is not None:
            try:
                check_peer_layout(msg.src)
                self._adopt(msg.src)
            except RlsyncError as exc:
                self._refuse_writer(identity, f"reader rank {self.rank} cannot receive from the writers' layout: {exc}")
                return
        if self.plan is None or self._landing is None:
            self._refuse_writer(identity, f"reader rank {self.rank} has no source layout and the writer sent none: "
                                          f"use a WeightsWriter of this rlsync version (it sends its layout)")
            return
        if msg.src_fingerprint != self.plan.src_fingerprint:
            self._refuse_writer(identity, f"the writer's source layout differs from the one reader rank {self.rank} plans "
                                          f"for (the first writer's): build every writer of this engine from the same source "
                                          f"layout (another model needs a new receiver: restart the engine's rlsync side)")
            return
        if self._checksum and not msg.checksums:
            self._refuse_writer(identity, f"reader rank {self.rank} checks every version's bytes (verify) and the writer "
                                          f"sends no checksums: build the trainer's writer with SyncOptions(verify=True) "
                                          f"(the same verify as the engine's: vLLM's init_info 'verify', verl's verify=true)")
            return
        if self.refusal is not None:
            _log.info("reader rank %d: writer rank %d welcomed; the earlier refusal no longer stands", self.rank, msg.writer_rank)
        self.refusal = None
        in_place = self.landing_mode == "in_place"
        welcome = Welcome(self.rank, self._transport.name, self._landing.describe(), self._version, self._target_slot,
                          checksum=for_memory(self._landing.memory), in_place=in_place)
        welcome.data_token = self._grant(msg.writer_rank)
        if msg.delta and not in_place:  # in place, the engine's tensors are the only copy: versions come whole
            inbox = self._open_inbox()
            welcome.inbox = inbox.describe()
            welcome.inbox_offset, welcome.inbox_capacity = self._inbox_parts.get(msg.writer_rank, (0, 0))
            inbox.admit(welcome.data_token, partial(self._writes_own_inbox_part, msg.writer_rank))
        self._channel.send(welcome, identity)  # in the writer's fresh session: bound to its nonce
        # the session counts for its writer rank only once it speaks again (its first Begin or Done)
        _keep_newest(self._welcomed, session.id, (msg.writer_rank, msg.session))
        self._hellos.setdefault(msg.writer_rank, set()).add(msg.session)

    def _grant(self, writer_rank: int) -> bytes:
        """A fresh data-plane token for a welcomed session of ``writer_rank``: its connections write that rank's own
        part of the slot being written and nothing else (a two-sided landing checks every write; ``Landing.admit``).
        A rank's two newest sessions keep theirs (one reconnecting while the other finishes); older ones are revoked."""
        assert self._landing is not None
        token = secrets.token_bytes(32)
        self._landing.admit(token, partial(self._writes_own_part, writer_rank))
        tokens = self._tokens.setdefault(writer_rank, [])
        tokens.append(token)
        while len(tokens) > 2:
            old = tokens.pop(0)
            for landing in (self._landing, self._inbox):
                if landing is not None:
                    landing.revoke(old)
        return token

    def _writes_own_part(self, writer_rank: int, slot: int, offset: int, nbytes: int) -> bool:
        """Whether ``nbytes`` at ``offset`` of ``slot`` lie in ``writer_rank``'s own runs of the slot being written
        (the plan's, merged where they touch). Called on the landing's threads for every write."""
        if slot != self._target_slot:
            return False
        spans = self._spans.get(writer_rank)
        if spans is None:
            spans = self._spans[writer_rank] = merged_spans(
                (d, d + n) for _, runs in self._pair_runs.get((writer_rank, self.rank), []) for _, d, n in runs)
        starts, ends = spans
        at = bisect.bisect_right(starts, offset) - 1
        return at >= 0 and offset + nbytes <= ends[at]

    def _writes_own_inbox_part(self, writer_rank: int, slot: int, offset: int, nbytes: int) -> bool:
        start, capacity = self._inbox_parts.get(writer_rank, (0, 0))
        return slot == 0 and start <= offset and offset + nbytes <= start + capacity

    def _activate(self, writer_rank: int, writer_session: str) -> None:
        """A new control session of ``writer_rank`` spoke: a writer that reconnected starts its version over; one
        whose writer session changed restarted, so what its earlier session did for an unfinished version is void."""
        previous = self._sessions.get(writer_rank)
        # a writer session welcomed since (one that died before it said Done may have written bytes) counts too
        others = self._hellos.pop(writer_rank, set()) - {writer_session}
        restarted = bool(others) or (previous is not None and previous[0] != writer_session)
        if restarted and self._paused_at is not None:
            self._undo(f"writer rank {writer_rank} restarted in the middle of version {self._pending_version}")
        if restarted:
            self._epoch += 1
            self._discard_partners(writer_rank, self._epoch - 1 if previous is None else previous[1])
        if previous is None or previous[0] != writer_session:
            self._sessions[writer_rank] = (writer_session, self._epoch)
        self._done.pop(writer_rank, None)  # a writer that reconnects starts its version over
        self._held.get(writer_rank, {}).pop(self._target_slot, None)  # it may have written part of the slot

    def _refuse_writer(self, identity: bytes | None, reason: str) -> None:
        """Refuse a writer at connect: it hears why, and so does the engine (``refusal``, ``on_refused``) at once
        instead of waiting out its timeout for a version that will not come."""
        reason = bounded(reason)
        self._count_rejection(reason, "refused %d writer(s)")
        self.refusal = reason
        if identity is not None:
            self._channel.send(Refuse(reason), identity)
        if self._on_refused is not None:
            self._on_refused(None, reason)


def merged_spans(spans: Iterable[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """``(starts, ends)`` of the byte ranges ``spans``, sorted, those that touch or overlap merged into one."""
    starts: list[int] = []
    ends: list[int] = []
    for start, end in sorted(spans):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], end)
        else:
            starts.append(start)
            ends.append(end)
    return starts, ends


def _keep_newest(table: dict[K, V], key: K, value: V) -> None:
    """``table[key] = value``, dropping the oldest entries past ``MAX_SESSIONS`` (what a peer can make grow is bounded)."""
    table[key] = value
    while len(table) > MAX_SESSIONS:
        table.pop(next(iter(table)))


def max_peer_tensors() -> int:
    """The most tensors a layout a writer declares may hold (``RLSYNC_MAX_PEER_TENSORS``, default 131,072: above the
    largest MoE checkpoints with one tensor per expert, Kimi-K2's 70,272). Planning for a peer's layout costs the
    reader's service thread about 55 microseconds and 3 KB per tensor (measured), before anything is checked."""
    return int(os.environ.get("RLSYNC_MAX_PEER_TENSORS", 1 << 17))


def check_peer_layout(src: Layout) -> None:
    """Refuse a writer's layout larger than ``max_peer_tensors`` (and 64 shards a tensor on average) before a plan is
    built for it."""
    most = max_peer_tensors()
    if len(src.tensors) > most or len(src.shards) > 64 * most:
        raise ConfigError(f"a writer's layout of {len(src.tensors)} tensors and {len(src.shards)} shards is larger than "
                          f"this reader plans for ({most} tensors, RLSYNC_MAX_PEER_TENSORS): refused")


MAX_REASON = 400  # characters of a refusal's reason kept: names in it are the peer's, of any length


def bounded(text: str, limit: int = MAX_REASON) -> str:
    """``text``, cut to ``limit`` characters (saying how long it was): what a peer chose goes into logs and answers."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _first_difference(theirs: Mapping[str, str], ours: Mapping[str, str]) -> str:
    """The first tensor two layouts disagree on, said plainly."""
    for name in [*theirs, *ours]:
        if name not in ours:
            return f"{name!r} is in the writer's and not in the engine's (an alias the engine ties, or a wrong name?)"
        if name not in theirs:
            return f"{name!r} is in the engine's and not in the writer's"
        if theirs[name] != ours[name]:
            return f"{name!r} differs (its shape, dtype or where it is held)"
    return "the same tensors, held differently"
