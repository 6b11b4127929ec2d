"""What the parts of a ``WeightsWriter`` share: its plan, its sessions with the readers, and the version in hand.

``WeightsWriter`` is built from two parts along its real seam, ``WriterSession`` (opening and dropping a session with
each reader) and ``VersionPosting`` (sending each version); both read and write the state declared and set here.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import pluggy
import torch

from rlsync.core.layouts import BufferSpec, Layout, PlanStats
from rlsync.core.sync._canary import Canary
from rlsync.core.sync._control import Channel, Done
from rlsync.core.sync._delta import ChangeLog
from rlsync.core.sync._device_order import CurrentStreams, Ready
from rlsync.core.sync._host_staging import HostStaging
from rlsync.core.sync._options import SyncOptions
from rlsync.core.sync._regions import PairRuns
from rlsync.core.sync._transport import Link, Run, Transport
from rlsync.core.sync._wire import WireCodec


_DATA_PTR = torch.Tensor.data_ptr  # called from C by map: no Python frame per tensor


class Binding:
    """The tensors a ``multi_put`` bound, each read in place: another ``multi_put`` of the same tensor objects, at the
    same addresses, in the same order, binds nothing new (checked in a few C-speed passes, not per tensor in Python).
    A trainer that re-allocated a tensor (a new storage: another address) binds again."""

    def __init__(self, names: tuple[str, ...], values: list[torch.Tensor], addresses: list[int]) -> None:
        self.names, self.values, self.addresses = names, values, addresses

    @classmethod
    def of(cls, tensors: Mapping[str, Any]) -> Binding | None:
        values = list(tensors.values())
        if not all(isinstance(t, torch.Tensor) for t in values):
            return None
        return cls(tuple(tensors), values, list(map(_DATA_PTR, values)))

    def holds(self, tensors: Mapping[str, Any]) -> bool:
        if len(tensors) != len(self.names) or tuple(tensors) != self.names:
            return False
        values = list(tensors.values())
        return all(map(operator.is_, values, self.values)) and list(map(_DATA_PTR, values)) == self.addresses


class WriterState:
    """The state of one writer rank; ``WeightsWriter.__init__`` plans it, then these start empty."""

    # the plan and its configuration (WeightsWriter.__init__)
    options: SyncOptions
    rank: int
    src: Layout
    dst: Layout
    timeout: float
    stats: PlanStats
    next_version: int
    bytes_per_version: int
    _plugins: pluggy.PluginManager
    _codec: WireCodec | None
    _readers: dict[int, str]
    _transport: type[Transport]
    _options: dict[str, Any]
    _secret: str | None
    _checksum: bool
    _session: str
    _fingerprints: tuple[str, str, dict[str, str]]
    _extra: set[str]
    _runs: dict[int, PairRuns]
    _specs: dict[str, BufferSpec]
    _needed: set[str]
    _part_bytes: dict[int, int]
    _itemsizes: dict[str, int]
    _changes: ChangeLog | None

    def _init_sessions(self) -> None:
        """No reader connected yet: each is, the first time a version goes to it (``WriterSession._connect``)."""
        self._channels: dict[int, Channel] = {}
        self._links: dict[int, Link] = {}
        self._slots: dict[int, int] = {}
        self._slot_runs: dict[tuple[int, int], list[list[Run]]] = {}  # (reader, slot) -> its runs as written there
        self._inboxes: dict[int, tuple[Link, int, int]] = {}  # reader rank -> (inbox link, offset, capacity)
        self._inbox_staging: dict[int, Any] = {}  # reader rank -> the buffer its deltas are written from, reused
        self._algorithms: dict[int, str] = {}  # reader rank -> the checksum it verifies with
        # in-place reader rank -> per group of its runs, those runs as (src, buffer index, offset in the buffer, n)
        self._in_place: dict[int, list[list[tuple[int, int, int, int]]]] = {}
        self._held: dict[int, dict[int, int]] = {}  # reader rank -> {slot: version this rank's part of it holds}
        self._sent: dict[int, int] = {}  # reader rank -> bytes the last version moved to it
        self._unsent: dict[int, Done] = {}  # reader rank -> its Done, written but not yet sent (a relay's barrier)

    def _init_versions(self) -> None:
        """Nothing put yet, nothing sent."""
        self._sources: dict[str, torch.Tensor] = {}  # uint8, on the host or (for a device transport) the device
        self._device_copies: dict[str, torch.Tensor] = {}  # contiguous copies of strided device sources, reused
        # with wire="delta" over a host transport: the device tensors staged to the host, where the changes are found
        # and encoded (on the device, at memory speed; the staged host copies are what a full version sends)
        self._delta_sources: dict[str, torch.Tensor] = {}
        self._streams = CurrentStreams()  # the streams device sources were put from, since the last version
        self._ready: Ready = []  # while a version is sent: an event on each of those streams
        self._staging = HostStaging()  # host copies of tensors put from device memory (or strided), reused
        self.last_bytes = 0
        self.last_delta_seconds = 0.0  # finding the changes and encoding the deltas of the last version
        self.last_canary_deviation: float | None = None  # the largest an engine reported for the last version
        #: with verify: per reader rank, the digest of this writer's checksums of the last version (what the reader
        #: reports back; ``rlsync.version_label`` of them, in reader order, is the label a one-writer engine shows)
        self.last_digests: dict[int, str] = {}
        # prepared versions: what does not change between versions is computed once and replayed
        self._epoch = 0  # counts bindings of sources (put): what was prepared under an older one is stale
        self._copies = 0  # puts that copied their tensor (staged to the host, or made contiguous on its device)
        self._binding: Binding | None = None  # the tensors of the last multi_put, when every one was read in place
        self._prepared: dict[tuple[int, int], tuple[int, Link, Any]] = {}  # (reader, slot) -> (epoch, link, prepared)
        self._names_at: tuple[int, list[str], list[str]] = (-1, [], [])  # (epoch, names put, names missing)

    # -- what each part calls on the other --------------------------------------------------------------------------

    def _connect(self, dst_rank: int) -> None:
        raise NotImplementedError

    def _drop(self, dst_rank: int) -> None:
        raise NotImplementedError

    def _ask_to_begin(self, dst_rank: int, version: int) -> str | None:
        raise NotImplementedError

    def complete(self, version: int, progress: Any = None, *, canary: Canary | None = None) -> None:
        raise NotImplementedError
