"""``WeightsReader``: the engine side of one rank. Versions land in transport memory and go live only
when every byte of a version has landed (and, with ``verify``, its CRC-32s match).

Landing modes:

* ``direct``: the regions are what the engine reads. Two slots: a version is written into the slot
  not being served, then the reader flips. A writer dying midway leaves the served slot untouched.
* ``staged``: one staging slot; when a version is complete the reader hands views of it to
  ``on_version`` (the engine's loader, a local copy) before the version counts as live.
* ``in_place``: the landing is the engine's own tensors (``targets``, one per buffer; a transport that can
  land in memory it did not allocate: ``cuda_ipc``, ``nixl``, ``memory``), one copy per byte and no staging.
  Before a version's first byte the writer asks (``Begin``); the reader pauses the engine (``pause(True)``,
  which returns once nothing reads the tensors) and answers ``Go``. The tensors' last version is kept in reused
  host buffers, refreshed after each commit while the engine serves: a version that fails its checksums or
  its ``on_version``, or whose writer dies or restarts before it completes (``timeout``), is undone from them,
  and the engine resumes (``pause(False)``) with the old version: never a mix, never nothing.

Writers that restart (a new session) make the reader discard unfinished parts that may pair with
bytes the dead session never finished (``_discard_partners``). Delta writers get an inbox
(``rlsync.core.sync._delta``).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, TypeVar

import numpy as np
import pluggy
import torch

from rlsync.core.layouts import replicated
from rlsync.core.sync._canary import Canary
from rlsync.core.sync._checksum import Checksums, digest, for_memory
from rlsync.core.sync._control import (
    Ack,
    AskLayout,
    BadFrame,
    Begin,
    Done,
    Go,
    Hello,
    Knock,
    LayoutIs,
    MAX_SESSIONS,
    Refuse,
    Session,
    Welcome,
    bind_router,
    bound_for,
)
from rlsync.core.sync._delta import INBOX_SHARE
from rlsync.core.sync._delta import apply as apply_delta
from rlsync.core.sync._device_order import synchronize_devices
from rlsync.core._errors import CanaryError, ConfigError, RlsyncError, TransferTimeoutError, WeightMismatchError
from rlsync.core.sync._host_staging import HostStaging
from rlsync.core.layouts import Layout, dtype_size, tensor_fingerprints
from rlsync.core.sync._memory import free_memory
from rlsync.core.sync._options import SyncOptions
from rlsync.core.layouts import Plan, build_plan
from rlsync.core.hooks import default_plugin_manager
from rlsync.core.sync._transport import resolve_transport
from rlsync.core.sync._regions import ALIGN, PairRuns, as_tensor, region_offsets, runs_by_pair
from rlsync.core.sync._transport import Landing, Region

#: ``"direct"`` (two slots in the engine's memory), ``"staged"`` (one slot, handed to ``on_version``) or
#: ``"in_place"`` (the engine's own tensors, the engine paused while a version lands)
LandingMode = Literal["direct", "staged", "in_place"]
MAX_VERSION = 2**53  # versions are step counts: a claim past this is no step (and no float64 holds it exactly)
REJECTIONS_LOGGED_EVERY = 10.0  # seconds between log lines about rejected messages (a stream of them is counted)
_log = logging.getLogger("rlsync")
K = TypeVar("K")
V = TypeVar("V")


class WeightsReader:
    """Engine side of one rank: receives versions into transport memory; see the module docstring.

    ``address`` is what writers connect to. ``version`` is the newest live version (-1: none).
    ``on_version(version, buffers)`` runs in the reader's service thread when a version's bytes
    have all landed, before it goes live; ``buffers`` maps buffer names to ``uint8`` views of the landing
    memory: numpy arrays for a host landing, torch tensors on the device for a device landing.
    If it raises, the version is refused and the previous one stays live. ``on_refused(version,
    reason)`` runs when a complete version is refused before that (its checksums did not match), and with
    ``version`` None when a writer is refused at connect (layouts, secret, a bad frame; ``refusal`` then says why
    until a writer is welcomed).

    ``options`` (``SyncOptions``): the transport, where to listen (``host``, ``port``), the ``secret``,
    and ``verify`` (refuse a version whose CRC-32s differ from the writers'). ``plugins``: the plugin
    manager whose hooks fire (default: the process's, ``rlsync.plugin_manager()``).
    """

    def __init__(
        self,
        src: Layout | None,
        dst: Layout | None,
        rank: int,
        *,
        replicas: int | None = None,
        options: SyncOptions | None = None,
        landing: LandingMode = "direct",
        on_version: Callable[[int, dict[str, Region]], None] | None = None,
        on_refused: Callable[[int | None, str], None] | None = None,
        plugins: pluggy.PluginManager | None = None,
        targets: Mapping[str, Region] | None = None,
        pause: Callable[[bool], None] | None = None,
    ) -> None:
        if landing not in ("direct", "staged", "in_place"):
            raise ValueError(f"landing must be 'direct', 'staged' or 'in_place', not {landing!r}")
        if (landing == "in_place") != (targets is not None) or (landing == "in_place" and dst is None):
            raise ConfigError("landing='in_place' needs the destination layout and targets={buffer: the engine's tensor} "
                              "(and only it takes targets)")
        self._targets = {name: as_tensor(t).reshape(-1).view(torch.uint8) for name, t in (targets or {}).items()}
        self._pause = pause or (lambda paused: None)
        self._paused_at: float | None = None  # in place: when the engine paused for the version landing now
        self._mirror = HostStaging()  # in place: the engine's last version, to undo a version that fails
        if dst is None and (replicas is None or replicas < 1 or src is not None):
            raise ConfigError("WeightsReader needs its destination layout, or dst=None with replicas=N (N readers "
                              "that each hold a whole copy of what the writers send, learned from their layout)")
        options = options or SyncOptions()
        self.options = options
        self.rank = rank
        self.landing_mode = landing
        self._plugins = plugins or default_plugin_manager()
        self.replicas = replicas
        self.dst: Layout | None = None
        self.plan: Plan | None = None
        self._expected: set[int] = set()
        self._pair_runs: dict[tuple[int, int], PairRuns] = {}
        self._tensors_of: dict[tuple[int, str], str] = {}  # (writer rank, its buffer) -> the tensor it holds
        self._transport = resolve_transport(options.transport, self._plugins)
        self._bound = bound_for(dst)  # the longest control message it takes (from its layout: set before it listens)
        self._channel, self.address = bind_router(options.host, options.port, options.secret, self._bound)
        # the data plane proves a key derived from the control plane's at connect (the tcp landing's challenge)
        self._transport_options = {**options.link_options, "secret": self._channel.data_key}
        self._landing: Landing | None = None
        if dst is not None:
            self._set_dst(dst)
        if src is not None:
            self._adopt(src)
        self._checksum = options.verify
        self._on_version = on_version
        self._on_refused = on_refused
        #: why the last writer that tried to connect was refused (a writer that proved the key: no stranger sets it,
        #: and an engine's wait fails while it stands); None again once a writer is welcomed
        self.refusal: str | None = None
        #: why the last message no honest writer sends was rejected (a bad frame, a wrong key, a replay): for a
        #: person to read; nothing waits on it
        self.last_rejection: str | None = None
        #: the trainer's canary of the version being handed to ``on_version`` (None outside it, or none sent)
        self.landed_canary: Canary | None = None
        #: set by the engine's check of ``landed_canary`` (``check_canary``); reported to the writers with the Ack
        self.canary_deviation: float | None = None
        #: with ``verify``: the live version's fingerprint (its writers' checksums, which the landed bytes matched);
        #: ``landed_digest``: the same of the version being handed to ``on_version``
        self.digest: str | None = None
        self.landed_digest: str | None = None
        self._live_slot = 0
        self._target_slot = 1 if landing == "direct" else 0
        self._version = -1
        self._pending_version: int | None = None
        self._done: dict[int, tuple[bytes, Done]] = {}
        self._sessions: dict[int, tuple[str, int]] = {}  # writer rank -> (session, epoch it started in)
        self._welcomed: dict[int, tuple[int, str]] = {}  # control session id -> (writer rank, its writer session)
        self._active: dict[int, int] = {}  # writer rank -> the control session its Begin/Done must come in
        self._hellos: dict[int, set[str]] = {}  # writer rank -> writer sessions welcomed since its last took effect
        self._nonces: dict[bytes, None] = {}  # writer nonces of the Knocks answered (newest MAX_SESSIONS): no replay
        self._fresh: dict[int, None] = {}  # sessions a Knock opened that have not spoken: a Hello or AskLayout may
        #: messages refused because they were not what an honest writer sends (bad frames, out of session, replays)
        self.rejected = 0
        self._logged_at = -REJECTIONS_LOGGED_EVERY  # when a rejection was last logged; those since are counted
        self._unlogged = 0
        self._epoch = 0  # counts writer restarts
        self.discarded: list[int] = []  # unfinished versions given up because a writer restarted
        self.delta_seconds = 0.0  # copying live parts and applying deltas, over every version so far
        self._held: dict[int, dict[int, int]] = {}  # writer rank -> {slot: the version its part of that slot holds}
        self._inbox: Landing | None = None  # where delta writers put their deltas
        self._inbox_parts: dict[int, tuple[int, int]] = {}  # writer rank -> (offset, capacity) in the inbox
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"rlsync-reader-{rank}", daemon=True)
        self._thread.start()

    def _set_dst(self, dst: Layout) -> None:
        """Receive into ``dst``: this rank's buffers and their landing memory."""
        offsets, nbytes = region_offsets(dst, self.rank)
        slots = 2 if self.landing_mode == "direct" else 1
        if self.landing_mode != "in_place":
            self._check_room(nbytes * slots, slots)
        self.dst = dst
        self._dst_fingerprint = dst.fingerprint()
        self._dst_tensors = tensor_fingerprints(dst)
        self._offsets, self._nbytes = offsets, nbytes
        self._sizes = {b.name: b.numel * dtype_size(b.dtype) for b in dst.buffers if b.rank == self.rank}
        self._order = list(self._offsets)  # the buffers in region order (region_offsets lays them out in that order)
        self._starts = [self._offsets[name] for name in self._order]
        if self.landing_mode == "in_place":
            missing = [n for n in self._order if n not in self._targets or self._targets[n].numel() != self._sizes[n]]
            if missing:
                raise WeightMismatchError(f"landing='in_place': no target tensor of the right size for buffer(s) {missing[:5]}")
            self._landing = self._transport.landing.over([self._targets[n] for n in self._order], self._transport_options)
            self._save()
            return
        self._landing = self._transport.landing(self._nbytes, slots, self._transport_options)

    def _check_room(self, nbytes: int, slots: int) -> None:
        """Refused before a byte is allocated where the landing cannot fit: filling it would get the process killed
        by the kernel mid-version (host memory, no traceback), and a replica's layout comes from a peer."""
        device = self._transport_options.get("device")
        room = free_memory(device)
        if nbytes > room:
            where = "host" if device is None else str(device)
            raise ConfigError(f"reader rank {self.rank}: its landing needs {nbytes / 2**30:.1f} GiB of landing memory "
                              f"({where}; {slots} slot(s), landing={self.landing_mode!r}), and {room / 2**30:.1f} GiB are "
                              f"free here: refused" + (" (landing='staged' keeps one slot)" if slots == 2 else ""))

    def _adopt(self, src: Layout) -> None:
        """Build this rank's plan from the writers' layout ``src``."""
        assert self.dst is not None
        self.plan = build_plan(src, self.dst, dst_ranks=[self.rank])
        self._expected = {t.src_rank for t in self.plan.transfers}
        self._pair_runs = runs_by_pair(self.plan.transfers, self._offsets)
        self._tensors_of = {(t.src_rank, t.src_buffer): t.tensor for t in self.plan.transfers}

    # -- what the engine uses --------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def memory(self) -> str:
        """Where versions land: ``"host"`` (numpy views) or ``"device"`` (torch views on the landing's device)."""
        return "host" if self._landing is None else self._landing.memory

    def region(self, slot: int | None = None) -> Region:
        """The whole landing region of ``slot`` (default: the live one), every buffer at its offset."""
        if self.landing_mode == "in_place":
            raise ConfigError("an in-place reader has no region: its buffers are the engine's tensors (buffers())")
        if self._landing is None:
            raise WeightMismatchError(f"reader rank {self.rank} has no landing yet: it learns its layout from the first writer")
        return self._landing.regions[self._live_slot if slot is None else slot]

    def buffers(self, slot: int | None = None) -> dict[str, Region]:
        """``uint8`` views of this rank's buffers in ``slot`` (default: the live one): numpy arrays for a host
        landing, device tensors for a device landing."""
        if self._landing is None:
            return {}
        if self.landing_mode == "in_place":
            return dict(self._targets)
        region = self._landing.regions[self._live_slot if slot is None else slot]
        return {name: region[off : off + self._sizes[name]] for name, off in self._offsets.items()}

    def wait_for_version(self, version: int | None = None, timeout: float | None = None) -> int:
        """Block until ``version`` (default: any version newer than now) is live; return the live version."""
        target = self._version + 1 if version is None else version
        with self._cond:
            if not self._cond.wait_for(lambda: self._version >= target or self._closed.is_set(), timeout):
                raise TransferTimeoutError(f"reader rank {self.rank}: version {target} did not arrive within {timeout} s")
        return self._version

    def get(self, name: str, out: np.ndarray | torch.Tensor) -> None:
        """Copy buffer ``name`` of the live version into the caller-owned ``out`` (a contiguous numpy array or
        tensor on any device, any dtype, the same number of bytes)."""
        self.multi_get({name: out})

    def multi_get(self, outs: Mapping[str, np.ndarray | torch.Tensor]) -> None:
        with self._cond:
            live = self.buffers()
            for name, out in outs.items():
                if name not in live:
                    raise WeightMismatchError(f"reader rank {self.rank} has no buffer {name!r}; it has {sorted(live)[:5]}...")
                target = as_tensor(out).reshape(-1).view(torch.uint8)
                source = as_tensor(live[name])
                if target.numel() != source.numel():
                    raise WeightMismatchError(f"buffer {name!r}: {source.numel()} bytes, but the destination has {target.numel()}")
                target.copy_(source)

    @property
    def lock(self) -> threading.Condition:
        """Held while a version flips; hold it while reading the live buffers to see one version."""
        return self._cond

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._channel.close()
        if self._landing is not None:
            self._landing.close()
        if self._inbox is not None:
            self._inbox.close()

    def __enter__(self) -> WeightsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the service thread ----------------------------------------------------------------

    def check_canary(self, logprobs_of: Callable[[list[list[int]]], Sequence[Sequence[float]]], *,
                     where: str = "the engine") -> float | None:
        """In ``on_version``, with the new version in place and before it serves: the engine's log-probs of the
        trainer's canary tokens (``logprobs_of(tokens)``) against the trainer's. Returns the mean deviation (also
        reported to the writers) or None when no canary came or ``options.canary`` is off; raises ``CanaryError``
        (the version is refused, the writers hear why) when it is above the canary's tolerance."""
        canary = self.landed_canary
        if canary is None or not self.options.canary:
            return None
        try:
            self.canary_deviation = canary.check(logprobs_of(canary.tokens), where=where)
        finally:
            _log.info("reader rank %d: canary deviation %s", self.rank, self.canary_deviation)
        return self.canary_deviation

    def _serve(self) -> None:
        while not self._closed.is_set():
            if self._landing is not None:
                self._landing.progress()
            if self._paused_at is not None and time.monotonic() - self._paused_at > self.options.timeout:
                self._undo(f"version {self._pending_version} did not complete within {self.options.timeout} s (a writer died?)")
            for _ in range(self._channel.failed_handshakes()):  # a peer without the key: counted, nothing else
                self._reject(None, "a peer failed the control socket's handshake: the peers' keys differ (another "
                                   "secret, an address without its #KEY, or a stranger)")
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
        self.rejected += 1
        self.last_rejection = reason
        self._unlogged += 1
        now = time.monotonic()
        if now - self._logged_at >= REJECTIONS_LOGGED_EVERY:
            _log.warning("reader rank %d rejected %d control message(s) since the last line (all are counted in "
                         "WeightsReader.rejected), the last: %s", self.rank, self._unlogged, reason)
            self._logged_at, self._unlogged = now, 0
        if identity is not None:
            try:
                self._channel.send(Refuse(reason), identity)
            except Exception:  # noqa: BLE001 - a peer that cannot be answered is left alone
                pass

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

    def _replicate(self, src: Layout | None) -> None:
        """A replica reader (``dst=None, replicas=N``) holds a whole copy of the writers' tensors."""
        if self.dst is None and src is not None and self.replicas is not None:
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
        session = self._channel.answer_knock(identity, knock, needs_src=self.plan is None, max_bytes=self._bound)
        _keep_newest(self._fresh, session.id, None)

    def _hello(self, identity: bytes, msg: Hello, session: Session) -> None:
        self._replicate(msg.src)
        if self.dst is not None and msg.dst_fingerprint != self._dst_fingerprint:
            self._refuse_writer(identity, f"the writer was built for another destination layout than reader rank {self.rank} "
                                          f"holds ({_first_difference(msg.dst_tensors, self._dst_tensors)}): build the "
                                          f"WeightsWriter with dst=None, and it learns the engine's layout from its readers")
            return
        if self.plan is None and msg.src is not None:
            try:
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
        if msg.delta and not in_place:  # in place, the engine's tensors are the only copy: versions come whole
            inbox = self._open_inbox()
            welcome.inbox = inbox.describe()
            welcome.inbox_offset, welcome.inbox_capacity = self._inbox_parts.get(msg.writer_rank, (0, 0))
        self._channel.send(welcome, identity)  # in the writer's fresh session: bound to its nonce
        # the session counts for its writer rank only once it speaks again (its first Begin or Done)
        _keep_newest(self._welcomed, session.id, (msg.writer_rank, msg.session))
        self._hellos.setdefault(msg.writer_rank, set()).add(msg.session)

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
        _log.warning("reader rank %d refused a writer: %s", self.rank, reason)
        self.refusal = reason
        if identity is not None:
            self._channel.send(Refuse(reason), identity)
        if self._on_refused is not None:
            self._on_refused(None, reason)

    def _open_inbox(self) -> Landing:
        """The inbox for delta writers: each writer a part of ``INBOX_SHARE`` times its bytes for this rank."""
        if self._inbox is None:
            at = 0
            for writer in sorted(self._expected):
                nbytes = sum(n for _, runs in self._pair_runs.get((writer, self.rank), []) for _, _, n in runs)
                capacity = -(-int(nbytes * INBOX_SHARE) // ALIGN) * ALIGN
                self._inbox_parts[writer] = (at, capacity)
                at += capacity
            self._inbox = self._transport.landing(max(at, ALIGN), 1, self._transport_options)
        return self._inbox

    def _discard_partners(self, restarted: int, epoch: int) -> None:
        """Writer rank ``restarted`` came back with a new session (its old one died, maybe mid-version). Parts of
        the unfinished version sent by sessions as old as the dead one may pair with bytes it never finished, so
        they are discarded and their senders told to send again; parts from sessions that started after an
        earlier restart (the rest of a restarting trainer) are kept. The slot is not live and the next version
        overwrites it."""
        stale = {r: d for r, d in self._done.items() if r != restarted and self._sessions[r][1] <= epoch}
        if not stale:
            return
        version = self._pending_version
        self._done = {r: d for r, d in self._done.items() if r not in stale}
        self.discarded.append(-1 if version is None else version)
        reason = (f"reader rank {self.rank} discarded the parts of unfinished version {version} from writer ranks "
                  f"{sorted(stale)}: writer rank {restarted} restarted before the version completed; complete it "
                  f"again from every writer rank")
        for ident, _ in stale.values():
            self._channel.send(Refuse(reason, "restart"), ident)

    def _finish_part(self, identity: bytes, msg: Done) -> None:
        if self.plan is None or msg.writer_rank not in self._sessions:
            self._channel.send(Refuse("send a Hello before Done"), identity)
            return
        refused = self._refused_version(msg.version)
        if refused is not None:
            self._channel.send(Refuse(refused, "version"), identity)
            return
        if msg.slot != self._target_slot:
            self._channel.send(Refuse(f"wrote slot {msg.slot}, expected {self._target_slot}; reconnect", "version"), identity)
            return
        held = self._held.get(msg.writer_rank, {}).pop(msg.slot, None)  # from here its part holds the new bytes
        if msg.delta_base is not None:
            error = self._land_delta(msg, held)
            if error is not None:
                self._channel.send(Refuse(error, "delta"), identity)
                return
        if self.landing_mode == "in_place" and self._paused_at is None:
            self._channel.send(Refuse(f"in-place reader rank {self.rank}: version {msg.version} was written without a "
                                      f"Begin, or after it was undone; send it again", "load"), identity)
            return
        if self._pending_version != msg.version:
            self._pending_version = msg.version
            self._done = {r: d for r, d in self._done.items() if d[1].version == msg.version}
        self._done[msg.writer_rank] = (identity, msg)
        if not self._expected <= self._done.keys():
            return
        done, self._done = self._done, {}
        self._pending_version = None
        error = self._verify(done) if self._checksum else None
        kind = "checksum" if error is not None else "load"
        if error is not None and self._on_refused is not None:
            self._on_refused(msg.version, error)
        self.landed_canary = next((d.canary for _, d in done.values() if d.canary is not None), None)
        sums = {w: d.checksums for w, (_, d) in done.items() if d.checksums is not None}
        self.landed_digest = digest(sums) if error is None and self._checksum and len(sums) == len(done) else None
        self.canary_deviation = None
        if error is None and self._on_version is not None:
            try:
                self._on_version(msg.version, self.buffers(self._target_slot))
            except CanaryError as exc:  # the engine computes with other weights than were sent: refused, named
                error, kind = str(exc), "canary"
            except Exception as exc:  # noqa: BLE001 - reported to every writer, version stays out
                error = f"the engine failed to load version {msg.version}: {exc!r}"
        self.landed_canary = None
        if error is not None:
            if self.landing_mode == "in_place":
                self._undo(error, msg.version)
            for ident, _ in done.values():
                self._channel.send(Refuse(error, kind), ident)
            return
        for writer in done:
            self._held.setdefault(writer, {})[self._target_slot] = msg.version
        with self._cond:
            if self.landing_mode == "direct":
                self._live_slot, self._target_slot = self._target_slot, self._live_slot
            self._version = msg.version
            self.digest = self.landed_digest
            self._cond.notify_all()
        self._resume()  # in place: the engine serves the new version
        for writer, (ident, _) in done.items():
            part = digest({writer: sums[writer]}) if writer in sums else None
            self._channel.send(Ack(msg.version, self._target_slot, self.canary_deviation, part), ident)
        if self.landing_mode == "in_place":
            self._save()  # the new last version, copied while the engine serves it; the next Begin waits for it
        stats: dict[str, object] = {"rank": self.rank, "writers": sorted(done)}
        if self.canary_deviation is not None:
            stats["canary_deviation"] = self.canary_deviation
        self._plugins.hook.rlsync_weights_applied(version=msg.version, stats=stats)

    def _refused_version(self, version: int) -> str | None:
        """Why a writer may not claim ``version``: it must be newer than the live one (a restarted trainer resumes
        at its own step, which is), and below ``MAX_VERSION`` (a step count, not any 64-bit number)."""
        if version <= self._version:
            return f"version {version} is not newer than live version {self._version}"
        if version >= MAX_VERSION:
            return f"version {version} is not a step count (at most {MAX_VERSION - 1}): refused"
        return None

    def _land_delta(self, msg: Done, held: int | None) -> str | None:
        """Write a writer's delta from its inbox part into the target slot; what went wrong, if anything."""
        offset, capacity = self._inbox_parts.get(msg.writer_rank, (0, 0))
        if self._inbox is None or msg.delta_nbytes > capacity:
            return f"reader rank {self.rank} has no inbox of {msg.delta_nbytes} bytes for writer rank {msg.writer_rank}: send in full"
        assert self._landing is not None
        started = time.perf_counter()
        try:
            return self._copy_and_apply(msg, held, offset)
        finally:
            self.delta_seconds += time.perf_counter() - started

    def _copy_and_apply(self, msg: Done, held: int | None, offset: int) -> str | None:
        assert self._landing is not None and self._inbox is not None
        if held != msg.delta_base:  # one step from the live slot: copy this writer's part of it here first, locally
            source = next((slot for slot, version in self._held.get(msg.writer_rank, {}).items()
                           if version == msg.delta_base and slot != msg.slot), None)
            if source is None:
                return (f"writer rank {msg.writer_rank} sent a delta against version {msg.delta_base}, but reader rank "
                        f"{self.rank} holds its part of that version in no slot (slot {msg.slot}: "
                        f"{'unknown bytes' if held is None else f'version {held}'}): send in full")
            into, out_of = as_tensor(self._landing.regions[msg.slot]), as_tensor(self._landing.regions[source])
            for _, runs in self._pair_runs.get((msg.writer_rank, self.rank), []):
                for _, at, nbytes in runs:
                    into[at : at + nbytes].copy_(out_of[at : at + nbytes])
        try:
            apply_delta(as_tensor(self._inbox.regions[0][offset : offset + msg.delta_nbytes]), as_tensor(self._landing.regions[msg.slot]))
        except ValueError as exc:
            return f"reader rank {self.rank}: a bad delta from writer rank {msg.writer_rank} ({exc}): send in full"
        return None

    def _verify(self, done: Mapping[int, tuple[bytes, Done]]) -> str | None:
        """Each writer's per-buffer CRC-32 against the bytes that landed; the first mismatch, named."""
        assert self.plan is not None and self._landing is not None
        for writer, (_, msg) in done.items():
            got = Checksums(for_memory(self._landing.memory))  # per source buffer, over its runs in plan order, as the writer
            for buffer, runs in self._pair_runs.get((writer, self.rank), []):
                got.add(buffer, (self._landed(self._target_slot, d, n) for _, d, n in runs))
            for buffer, value in got.values.items():
                sent = None if msg.checksums is None else msg.checksums.get(buffer)
                if sent != value:
                    tensor = self._tensors_of.get((writer, buffer), buffer)
                    return (f"checksum mismatch in tensor {tensor!r} (from writer rank {writer}) for version {msg.version}: "
                            f"what landed differs from what was sent; version refused, the previous one stays live")
        return None

    def _landed(self, slot: int, offset: int, nbytes: int) -> Region:
        """``nbytes`` that landed at ``offset`` of ``slot`` (in place: inside the buffer that offset falls in)."""
        assert self._landing is not None
        if self.landing_mode != "in_place":
            return self._landing.regions[slot][offset : offset + nbytes]
        index = bisect.bisect_right(self._starts, offset) - 1
        at = offset - self._starts[index]
        return self._targets[self._order[index]][at : at + nbytes]

    # -- in place: pause, save, undo ---------------------------------------------------------

    def _begin(self, identity: bytes, msg: Begin) -> None:
        """A writer is about to write ``msg.version`` into the engine's tensors: pause the engine, then say go. To a
        reader that lands off to the side, a Begin asks only whether it would take ``msg.version`` (a node relay asks
        every reader of its host after writing their bytes and before telling any: one that died or would refuse
        is found while every rank still serves the previous version)."""
        if msg.writer_rank not in self._sessions:
            self._channel.send(Refuse("a Begin before a Hello"), identity)
            return
        refused = self._refused_version(msg.version)
        if refused is not None:
            self._channel.send(Refuse(refused, "version"), identity)
            return
        if self.landing_mode != "in_place":
            self._channel.send(Go(msg.version), identity)
            return
        if self._paused_at is None:
            self._mirror.wait()  # the last version is saved before a byte of the next lands
            self._pause(True)
            synchronize_devices(self._targets.values())  # what the engine queued on its device reads the old bytes first
            self._paused_at = time.monotonic()
            self._pending_version = msg.version
        self._channel.send(Go(msg.version), identity)

    def _save(self) -> None:
        for name in self._order:
            self._mirror.stage(name, self._targets[name])

    def _undo(self, reason: str, version: int | None = None) -> None:
        """Put the engine's last version back into its tensors and resume it: the version landing now is void."""
        version = self._pending_version if version is None else version
        _log.warning("in-place reader rank %d: %s; version %d restored", self.rank, reason, self._version)
        self._mirror.wait()
        saved = self._mirror.buffers
        for name in self._order:
            self._targets[name].copy_(saved[name])
        synchronize_devices(self._targets.values())  # restored before the engine's next forward, on whatever stream it runs
        self._done = {}
        self.discarded.append(-1 if version is None else version)
        self._pending_version = None
        self._resume()

    def _resume(self) -> None:
        if self._paused_at is not None:
            self._paused_at = None
            self._pause(False)


def _keep_newest(table: dict[K, V], key: K, value: V) -> None:
    """``table[key] = value``, dropping the oldest entries past ``MAX_SESSIONS`` (what a peer can make grow is bounded)."""
    table[key] = value
    while len(table) > MAX_SESSIONS:
        table.pop(next(iter(table)))


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
