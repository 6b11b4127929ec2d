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

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import pluggy
import torch

from rlsync.core.sync._control import (
    bind_router,
    bound_for,
)
from rlsync.core._errors import ConfigError, TransferTimeoutError, WeightMismatchError, whole_number
from rlsync.core.layouts import Layout, dtype_size, tensor_fingerprints
from rlsync.core.sync._memory import free_memory
from rlsync.core.sync._options import SyncOptions
from rlsync.core.layouts import build_plan
from rlsync.core.hooks import default_plugin_manager
from rlsync.core.sync._transport import resolve_transport
from rlsync.core.sync._reader_service import ReaderService
from rlsync.core.sync._reader_state import LandingMode, ReaderState
from rlsync.core.sync._reader_versions import VersionLanding
from rlsync.core.sync._regions import as_tensor, region_offsets, runs_by_pair
from rlsync.core.sync._transport import Region

_log = logging.getLogger("rlsync")


class WeightsReader(ReaderService, VersionLanding):
    """Engine side of one rank: receives versions into transport memory; see the module docstring.

    ``address`` is what writers connect to. ``version`` is the newest live version (-1: none).
    ``on_version(version, buffers)`` runs in the reader's service thread when a version's bytes
    have all landed, before it goes live; ``buffers`` maps buffer names to ``uint8`` views of the landing
    memory: numpy arrays for a host landing, torch tensors on the device for a device landing.
    If it raises, the version is refused and the previous one stays live. ``on_refused(version,
    reason)`` runs when a complete version is refused before that (its checksums did not match), and with
    ``version`` None when a writer is refused at connect (layouts, secret, a bad frame; ``refusal`` then says why
    until a writer is welcomed). ``on_lost(version, reason)`` runs when a writer's connection closes before it
    finished its part of ``version`` (a trainer rank that died): the version is given up then, not at the timeout.

    ``options`` (``SyncOptions``): the transport, where to listen (``host``, ``port``), the ``secret``,
    and ``verify`` (refuse a version whose CRC-32s differ from the writers'). ``plugins``: the plugin
    manager whose hooks fire (default: the process's, ``rlsync.plugin_manager()``). ``live_version``: the version the
    engine serves as this reader starts (-1: none), for a reader that replaces another in the same engine (writers go
    on after it; ``landing`` staged or in place, whose engine holds that version itself).
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
        live_version: int = -1,
        on_lost: Callable[[int, str], None] | None = None,
    ) -> None:
        if landing not in ("direct", "staged", "in_place"):
            raise ConfigError(f"landing={landing!r}: 'direct', 'staged' or 'in_place'")
        rank = whole_number("rank", rank, 0)
        if (landing == "in_place") != (targets is not None) or (landing == "in_place" and dst is None):
            raise ConfigError("landing='in_place' needs the destination layout and targets={buffer: the engine's tensor} "
                              "(and only it takes targets)")
        if dst is None and (replicas is None or replicas < 1 or src is not None):
            raise ConfigError("WeightsReader needs its destination layout, or dst=None with replicas=N (N readers "
                              "that each hold a whole copy of what the writers send, learned from their layout)")
        options = options or SyncOptions()
        ReaderState.__init__(self, rank, options, landing, replicas, plugins or default_plugin_manager(), on_version,
                             on_refused, targets, pause, on_lost)
        if live_version != -1:
            if landing == "direct":
                raise ConfigError("live_version: a direct landing serves its own slots, which hold no version yet")
            self._version = whole_number("live_version", live_version, -1)
        self._transport = resolve_transport(options.transport, self._plugins)
        self._bound = bound_for(dst)  # the longest control message it takes (from its layout: set before it listens)
        self._channel, self.address = bind_router(options.host, options.port, options.secret, self._bound)
        # the data plane proves a key derived from the control plane's at connect (the tcp landing's challenge)
        self._transport_options = {**options.link_options, "secret": self._channel.data_key}
        try:
            if dst is not None:
                self._set_dst(dst)
            if src is not None:
                self._adopt(src)
        except BaseException:  # a reader refused at its start leaves no socket listening (nor a monitor unread)
            self._channel.close()
            if self._landing is not None:
                self._landing.close()
            raise
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
        self._spans = {}  # the writers' own byte ranges come from the plan: found again
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

    # -- in place: pause, save, undo ---------------------------------------------------------
