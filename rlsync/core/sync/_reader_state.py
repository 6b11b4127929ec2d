"""What the parts of a ``WeightsReader`` share: its configuration, its landing and its version state.

``WeightsReader`` is built from two parts along its real seam, ``ReaderService`` (the control socket's thread) and
``VersionLanding`` (the version state: slots, commit, undo); both read and write the state declared and set here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Literal

import pluggy
import torch

from rlsync.core.layouts import Layout, Plan
from rlsync.core.sync._canary import Canary
from rlsync.core.sync._control import Channel, Done
from rlsync.core.sync._host_staging import HostStaging
from rlsync.core.sync._options import SyncOptions
from rlsync.core.sync._regions import PairRuns, as_tensor
from rlsync.core.sync._transport import Landing, Region, Transport

#: ``"direct"`` (two slots in the engine's memory), ``"staged"`` (one slot, handed to ``on_version``) or
#: ``"in_place"`` (the engine's own tensors, the engine paused while a version lands)
LandingMode = Literal["direct", "staged", "in_place"]


class ReaderState:
    """The state of one reader, empty (no layout, no version); ``WeightsReader.__init__`` binds it and lands it."""

    # set once the reader listens and knows its layout (WeightsReader.__init__, _set_dst)
    address: str
    _channel: Channel
    _bound: int
    _transport: type[Transport]
    _transport_options: dict[str, Any]
    _dst_fingerprint: str
    _dst_tensors: dict[str, str]
    _offsets: dict[str, int]
    _nbytes: int
    _sizes: dict[str, int]
    _order: list[str]
    _starts: list[int]
    _thread: threading.Thread

    def __init__(self, rank: int, options: SyncOptions, landing: LandingMode, replicas: int | None,
                 plugins: pluggy.PluginManager, on_version: Callable[[int, dict[str, Region]], None] | None,
                 on_refused: Callable[[int | None, str], None] | None, targets: Mapping[str, Region] | None,
                 pause: Callable[[bool], None] | None, on_lost: Callable[[int, str], None] | None) -> None:
        self.options = options
        self.rank = rank
        self.landing_mode: LandingMode = landing
        self.replicas = replicas
        self._plugins = plugins
        self._checksum = options.verify
        self._on_version = on_version
        self._on_refused = on_refused
        self._on_lost = on_lost
        self._targets = {name: as_tensor(t).reshape(-1).view(torch.uint8) for name, t in (targets or {}).items()}
        self._pause = pause or (lambda paused: None)
        self._paused_at: float | None = None  # in place: when the engine paused for the version landing now
        self._mirror = HostStaging()  # in place: the engine's last version, to undo a version that fails
        self.dst: Layout | None = None
        self.plan: Plan | None = None
        self._landing: Landing | None = None
        self._expected: set[int] = set()
        self._pair_runs: dict[tuple[int, int], PairRuns] = {}
        self._tensors_of: dict[tuple[int, str], str] = {}  # (writer rank, its buffer) -> the tensor it holds
        self._init_sessions()
        self._init_versions()
        self._cond = threading.Condition()
        self._closed = threading.Event()

    def _init_sessions(self) -> None:
        #: why the last writer that tried to connect was refused (a writer that proved the key: no stranger sets it,
        #: and an engine's wait fails while it stands); None again once a writer is welcomed
        self.refusal: str | None = None
        #: why the last message no honest writer sends was rejected (a bad frame, a wrong key, a replay): for a
        #: person to read; nothing waits on it
        self.last_rejection: str | None = None
        #: messages refused because they were not what an honest writer sends (bad frames, out of session, replays)
        self.rejected = 0
        self._logged_at = float("-inf")  # when a rejection was last logged; those since are counted
        self._unlogged = 0
        self._sessions: dict[int, tuple[str, int]] = {}  # writer rank -> (session, epoch it started in)
        self._welcomed: dict[int, tuple[int, str]] = {}  # control session id -> (writer rank, its writer session)
        self._active: dict[int, int] = {}  # writer rank -> the control session its Begin/Done must come in
        self._hellos: dict[int, set[str]] = {}  # writer rank -> writer sessions welcomed since its last took effect
        self._nonces: dict[bytes, None] = {}  # writer nonces of the Knocks answered (newest MAX_SESSIONS): no replay
        self._fresh: dict[int, None] = {}  # sessions a Knock opened that have not spoken: a Hello or AskLayout may
        self._epoch = 0  # counts writer restarts
        self._tokens: dict[int, list[bytes]] = {}  # writer rank -> its sessions' data-plane tokens, newest last
        self._spans: dict[int, tuple[list[int], list[int]]] = {}  # writer rank -> its own runs' byte ranges (the plan's)

    def _init_versions(self) -> None:
        #: the trainer's canary of the version being handed to ``on_version`` (None outside it, or none sent)
        self.landed_canary: Canary | None = None
        #: set by the engine's check of ``landed_canary`` (``check_canary``); reported to the writers with the Ack
        self.canary_deviation: float | None = None
        #: with ``verify``: the live version's fingerprint (its writers' checksums, which the landed bytes matched);
        #: ``landed_digest``: the same of the version being handed to ``on_version``
        self.digest: str | None = None
        self.landed_digest: str | None = None
        self._live_slot = 0
        self._target_slot = 1 if self.landing_mode == "direct" else 0
        self._version = -1
        self._pending_version: int | None = None
        self._done: dict[int, tuple[bytes, Done]] = {}
        self.discarded: list[int] = []  # unfinished versions given up because a writer restarted
        self.delta_seconds = 0.0  # copying live parts and applying deltas, over every version so far
        #: seconds from the Done that completed the last live version to its Acks (checks, on_version, the flip)
        self.last_commit_seconds = 0.0
        self._held: dict[int, dict[int, int]] = {}  # writer rank -> {slot: the version its part of that slot holds}
        self._inbox: Landing | None = None  # where delta writers put their deltas
        self._inbox_parts: dict[int, tuple[int, int]] = {}  # writer rank -> (offset, capacity) in the inbox

    # -- what each part calls on the other (and on the reader itself) ---------------------------------------------

    def _set_dst(self, dst: Layout) -> None:
        raise NotImplementedError

    def _adopt(self, src: Layout) -> None:
        raise NotImplementedError

    def buffers(self, slot: int | None = None) -> dict[str, Region]:
        raise NotImplementedError

    def _reject(self, identity: bytes | None, reason: str) -> None:
        raise NotImplementedError

    def _open_inbox(self) -> Landing:
        raise NotImplementedError

    def _discard_partners(self, restarted: int, epoch: int) -> None:
        raise NotImplementedError

    def _finish_part(self, identity: bytes, msg: Done) -> None:
        raise NotImplementedError

    def _begin(self, identity: bytes, msg: Any) -> None:
        raise NotImplementedError

    def _undo(self, reason: str, version: int | None = None) -> None:
        raise NotImplementedError

    def _lost_part(self, reason: str) -> None:
        raise NotImplementedError

    def _resume(self) -> None:
        raise NotImplementedError

    def _save(self) -> None:
        raise NotImplementedError
