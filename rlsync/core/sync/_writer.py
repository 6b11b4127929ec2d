"""``WeightsWriter``: the trainer side of one rank. ``put``/``multi_put`` this rank's tensors, then
``complete(version)`` sends its part to every reader at once and returns when each has it live.

A writer whose options say ``wire="delta"`` sends, where it can, only the values that changed since the
version its part of the reader's target slot holds (``rlsync.core.sync._delta``), into an inbox the reader
allocates for it; it sends in full when it does not know what the slot holds, or when the delta would
not fit. A wire codec (``wire="fp8"``, registered through ``rlsync_register_wire_codecs``) changes the
layout that crosses and encodes each tensor in ``put``.
"""

from __future__ import annotations

import bisect
import logging
import secrets
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pluggy
import torch

from rlsync.core.layouts import tied_aliases
from rlsync.core.sync._canary import Canary
from rlsync.core.sync._checksum import Checksums, digest
from rlsync.core.sync._control import (
    Ack,
    Begin,
    Channel,
    Done,
    Go,
    Hello,
    Refuse,
    Welcome,
    open_channel,
)
from rlsync.core.sync._delta import ChangeLog
from rlsync.core.sync._delta import encode as encode_delta
from rlsync.core.sync._device_order import CurrentStreams, Ready, ready_events, wait_ready
from rlsync.core._errors import (
    CanaryError,
    ConfigError,
    PeerLostError,
    PlanError,
    RlsyncWarning,
    TransferTimeoutError,
    TransportError,
    VersionError,
    WeightMismatchError,
)
from rlsync.core.sync._host_staging import HostStaging
from rlsync.core.layouts import Layout, dtype_size
from rlsync.core.sync._layout_exchange import ask_layout
from rlsync.core.sync._options import SyncOptions
from rlsync.core.layouts import build_plan
from rlsync.core.hooks import default_plugin_manager, wire_codecs
from rlsync.core.sync._transport import resolve_transport
from rlsync.core.sync._regions import PairRuns, as_bytes, region_offsets, runs_by_pair
from rlsync.core.sync._transport import Link, Run
from rlsync.core.sync._wire import WireCodec

_log = logging.getLogger("rlsync")


class WeightsWriter:
    """Trainer side of one rank: ``put``/``multi_put`` this rank's buffers, then ``complete(version)``.

    ``readers`` maps each destination rank to its reader's ``address``. ``dst=None`` asks the
    first reader for the destination layout (readers know it: an engine derives it from its own
    loader), so a trainer needs nothing but its own layout and the addresses; tensors of ``src``
    that the destination does not hold (a tied ``lm_head.weight``, say) are then simply not sent.

    ``complete`` sends this rank's part to every reader at once (one thread per reader), notifies
    them, and returns once each has the version live; a reader that does not confirm within
    ``timeout`` raises ``TransferTimeoutError`` naming it, after the others got the version.

    ``options`` (``SyncOptions``): transport, secret, timeout, ``verify`` (send CRC-32s the readers check)
    and ``wire``, what crosses (off by default: ``"full"``, every byte of every version):

    * ``"delta"``: only what changed since the version a reader's slot holds (see the module
      docstring); the writer keeps a copy of its last version's bytes to find the changes.
    * ``"fp8"``: for an engine that serves the fp8 block-quantized checkpoint format
      (``rlsync.wire.Fp8Codec``): ``src`` stays the trainer's layout, ``put`` takes the model-dtype tensors
      and quantizes the weights that format quantizes (each shard on 128-element block bounds).
    * ``"fp8+delta"``: both.

    ``last_bytes`` is what the last ``complete`` moved to all readers.
    """

    def __init__(
        self,
        src: Layout,
        dst: Layout | None,
        rank: int,
        readers: Mapping[int, str] | Sequence[str],
        *,
        options: SyncOptions | None = None,
        plugins: pluggy.PluginManager | None = None,
    ) -> None:
        options = options or SyncOptions()
        self.options = options
        self._plugins = plugins or default_plugin_manager()
        self._codec: WireCodec | None = None
        if options.codec is not None:
            self._codec = wire_codecs(self._plugins).create(options.codec, src, rank)
            src = self._codec.layout
        delta = options.delta
        secret, timeout = options.secret, options.timeout
        self.rank = rank
        self._readers = dict(enumerate(readers)) if not isinstance(readers, Mapping) else dict(readers)
        self.next_version = 1  # with dst=None: the first reader's live version + 1
        if dst is None:
            if not self._readers:
                raise WeightMismatchError("WeightsWriter needs the readers' addresses to learn the destination layout")
            dst, live = ask_layout(self._readers[min(self._readers)], src, secret, timeout)
            self.next_version = live + 1
        self.src, self.dst = src, dst
        unknown = sorted(r for r in self._readers if not 0 <= r < dst.world_size)
        if unknown:  # e.g. one address per engine replica given to one writer: the extra ones would never get a byte
            raise ConfigError(f"WeightsWriter got reader addresses for ranks {unknown}, but the engine's layout has "
                              f"{dst.world_size} rank(s): give one address per engine rank, and one WeightsWriter per "
                              f"engine replica")
        plan = build_plan(src, dst)
        # what the trainer exports and the engine does not hold: named at the first multi_put (SyncOptions.extra_tensors)
        self._extra = set() if options.extra_tensors == "ignore" else set(src.tensor_map()) - set(dst.tensor_map())
        self.stats = plan.stats  # the whole plan's: bytes sent by all writer ranks, the busiest sender's share
        self._fingerprints = (plan.src_fingerprint, plan.dst_fingerprint, plan.dst_tensors)
        self._session = secrets.token_hex(8)
        mine = plan.for_src_rank(rank)
        self._runs: dict[int, PairRuns] = {}
        for dst_rank in sorted({t.dst_rank for t in mine}):
            if dst_rank not in self._readers:
                raise WeightMismatchError(f"writer rank {rank} sends to destination rank {dst_rank}, but no reader address was given for it")
            offsets, _ = region_offsets(dst, dst_rank)
            self._runs[dst_rank] = runs_by_pair((t for t in mine if t.dst_rank == dst_rank), offsets)[(rank, dst_rank)]
        self._specs = {b.name: b for b in src.buffers if b.rank == rank}
        self._needed = {name for groups in self._runs.values() for name, _ in groups}
        self._slot_runs: dict[tuple[int, int], list[list[Run]]] = {}  # (reader, slot) -> its runs as written there
        self._transport = resolve_transport(options.transport, self._plugins)
        self._options = options.link_options
        self._secret = secret
        self._checksum = options.verify
        self.timeout = timeout
        self._sources: dict[str, torch.Tensor] = {}  # uint8, on the host or (for a device transport) the device
        self._device_copies: dict[str, torch.Tensor] = {}  # contiguous copies of strided device sources, reused
        # with wire="delta" over a host transport: the device tensors staged to the host, where the changes are found
        # and encoded (on the device, at memory speed; the staged host copies are what a full version sends)
        self._delta_sources: dict[str, torch.Tensor] = {}
        self._streams = CurrentStreams()  # the streams device sources were put from, since the last version
        self._ready: Ready = []  # while a version is sent: an event on each of those streams
        self._channels: dict[int, Channel] = {}
        self._links: dict[int, Link] = {}
        self._slots: dict[int, int] = {}
        self._part_bytes = {r: sum(n for _, runs in groups for _, _, n in runs) for r, groups in self._runs.items()}  # full send, per reader
        self.bytes_per_version = sum(self._part_bytes.values())
        self._itemsizes = {name: dtype_size(b.dtype) for name, b in self._specs.items()}
        self._changes = ChangeLog(self._itemsizes) if delta else None
        if delta and not self._transport.compress_deltas:  # said, not refused: a user may measure it for themselves
            _log.warning("WeightsWriter rank %d: wire='delta' over transport %r, where a full version usually lands "
                         "sooner (measured: 1 GB over shared memory 0.24 s full, 2.0 s as a delta on 2 CPU cores; 4 GiB over "
                         "cuda_ipc on an H100 26 ms full, 138 ms as a delta). A delta pays where the link is the limit (tcp "
                         "across hosts, below about 6 Gbit/s per writer rank on 2 CPU cores, about 14 Gbit/s from an H100 "
                         "into host readers): wire='full' here",
                         rank, self._transport.name)
        self._inboxes: dict[int, tuple[Link, int, int]] = {}  # reader rank -> (inbox link, offset, capacity)
        self._inbox_staging: dict[int, Any] = {}  # reader rank -> the buffer its deltas are written from, reused
        self._algorithms: dict[int, str] = {}  # reader rank -> the checksum it verifies with
        # in-place reader rank -> per group of its runs, those runs as (src, buffer index, offset in the buffer, n)
        self._in_place: dict[int, list[list[tuple[int, int, int, int]]]] = {}
        self._held: dict[int, dict[int, int]] = {}  # reader rank -> {slot: version this rank's part of it holds}
        self._sent: dict[int, int] = {}  # reader rank -> bytes the last version moved to it
        self._staging = HostStaging()  # host copies of tensors put from device memory (or strided), reused
        self.last_bytes = 0
        self.last_delta_seconds = 0.0  # finding the changes and encoding the deltas of the last version
        self.last_canary_deviation: float | None = None  # the largest an engine reported for the last version
        #: with verify: per reader rank, the digest of this writer's checksums of the last version (what the reader
        #: reports back; ``rlsync.version_label`` of them, in reader order, is the label a one-writer engine shows)
        self.last_digests: dict[int, str] = {}
        self._unsent: dict[int, Done] = {}  # reader rank -> its Done, written but not yet sent (a relay's barrier)

    def put(self, name: str, tensor: Any) -> None:
        """Bind this rank's buffer ``name`` (for plain and FSDP layouts: the parameter name) to ``tensor``.

        ``tensor``: a torch tensor on any device, or a numpy array, of the layout's dtype and size. A contiguous
        host tensor is read in place when ``complete`` runs: keep it alive and unchanged until then. Device
        memory (a GPU trainer's parameters) and strided views are copied now into a host buffer that this writer
        allocates once (pinned where CUDA runs) and reuses every version; the copy from a GPU is asynchronous,
        and ``complete`` waits for it. Cast on the device before ``put`` (``t.to(torch.bfloat16)``), so that the
        smaller dtype is what crosses PCIe.
        """
        if self._codec is not None:
            encoded = self._codec.encode(name, tensor)
            if encoded is not None:  # the codec's tensors replace this one (fp8: the weight and its scales)
                for part, value in encoded.items():
                    self._put_raw(part, value)
                return
        self._put_raw(name, tensor)

    def _put_raw(self, name: str, tensor: Any) -> None:
        spec = self._specs.get(name)
        if spec is None:
            near = sorted(self._specs)[:5]
            raise WeightMismatchError(f"writer rank {self.rank} has no buffer {name!r} in its layout; it has e.g. {near}")
        changed = self._plugins.hook.rlsync_transform_tensor(name=name, tensor=tensor)
        tensor = tensor if changed is None else changed
        dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
        if dtype != spec.dtype:
            raise WeightMismatchError(f"tensor {name!r}: dtype {dtype} but the layout says {spec.dtype}; cast it before put()")
        numel = int(tensor.numel()) if callable(getattr(tensor, "numel", None)) else int(tensor.size)
        if numel != spec.numel:
            raise WeightMismatchError(f"tensor {name!r}: {numel} elements but the layout says {spec.numel} (shape {tuple(tensor.shape)})")
        self._delta_sources.pop(name, None)
        if isinstance(tensor, np.ndarray):
            self._sources[name] = as_bytes(name, tensor)
        elif tensor.device.type != "cpu" and self._transport.device_sources:
            # the transport reads device memory itself (cuda_ipc, nixl): no bounce through the host; the copy may
            # run in another thread, whose current stream is not this one: it waits for this event first
            self._sources[name] = as_bytes(name, tensor if tensor.is_contiguous() else self._contiguous_copy(name, tensor))
            self._streams.note(tensor)
        elif self._staging.needs_staging(tensor):
            # device memory or a strided view: copied (asynchronously from a GPU) into a reused host buffer;
            # each buffer is sent once its own copy is done, so PCIe and the sending overlap
            if tensor.device.type != "cpu" and not self._staging.nbytes:  # said once per writer: the slow path is a choice
                _log.warning("WeightsWriter rank %d: %s tensors go through host memory for transport %r (bound by PCIe, "
                             "about 50 GB/s); transport='cuda_ipc' (same host) or 'nixl' moves device memory directly",
                             self.rank, tensor.device.type, self._transport.name)
            self._sources[name] = as_bytes(name, self._staging.stage(name, tensor))
            if self._changes is not None and tensor.device.type != "cpu":  # a GPU trainer's delta: found on the GPU
                self._delta_sources[name] = as_bytes(name, tensor if tensor.is_contiguous() else self._contiguous_copy(name, tensor))
                self._streams.note(tensor)
        else:
            self._sources[name] = as_bytes(name, tensor)

    def _contiguous_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A strided device tensor copied into a contiguous buffer on its device, allocated once per name and reused
        every version (a transport that registers memory, NIXL, then registers it once, not every version)."""
        buffer = self._device_copies.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or buffer.device != tensor.device:
            buffer = self._device_copies[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
        return buffer.copy_(tensor)

    def multi_put(self, tensors: Mapping[str, Any]) -> None:
        """``put`` each of ``tensors``; the first time, also say which of them the engine does not hold."""
        if self._extra:
            self._name_extra(tensors)
        for name, tensor in tensors.items():
            self.put(name, tensor)

    def _name_extra(self, tensors: Mapping[str, Any]) -> None:
        """Tensors put that the engine does not hold are not sent: an error or a warning (``extra_tensors``), once.
        A tied alias (one tensor under a second name) is not extra: the engine ties it itself."""
        torch_only = all(isinstance(t, torch.Tensor) for t in tensors.values())
        aliases = tied_aliases(tensors) if torch_only else set()
        extra = sorted(name for name in tensors if name in self._extra and name not in aliases)
        self._extra = set()
        if not extra:
            return
        listed = ", ".join(repr(n) for n in extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        message = (f"writer rank {self.rank}: {len(extra)} tensor(s) put that the engine does not hold, not sent: {listed}; "
                   f"rename them to the engine's names, or leave them out, or SyncOptions(extra_tensors='ignore') if "
                   f"they are meant to stay behind")
        if self.options.extra_tensors == "error":
            raise PlanError(message)
        warnings.warn(message, RlsyncWarning, stacklevel=3)

    def _connect(self, dst_rank: int) -> None:
        if dst_rank in self._links:
            return
        channel, challenge = open_channel(self._readers[dst_rank], self._secret, self.timeout)
        src_fp, dst_fp, dst_tensors = self._fingerprints
        try:
            channel.send(Hello(self.rank, src_fp, dst_fp, dst_tensors, self._session, self.src if challenge.needs_src else None,
                               delta=self._changes is not None, checksums=self._checksum))
            got = channel.recv(timeout_ms=int(self.timeout * 1000))
        except (TransportError, ConfigError):
            channel.close()
            raise
        if got is None:
            channel.close()
            raise TransferTimeoutError(f"reader rank {dst_rank} at {self._readers[dst_rank]} did not answer within {self.timeout} s")
        msg = got[1]
        if isinstance(msg, Refuse):
            channel.close()
            raise WeightMismatchError(f"reader rank {dst_rank} refused: {msg.reason}")
        if not isinstance(msg, Welcome):
            channel.close()
            raise TransportError(f"reader rank {dst_rank} answered {type(msg).__name__} to a Hello: "
                                 f"is {self._readers[dst_rank]} a reader of this rlsync version?")
        if msg.transport != self._transport.name:
            channel.close()
            raise TransportError(f"reader rank {dst_rank} uses transport {msg.transport!r}, this writer {self._transport.name!r}")
        # the data plane proves a key derived from the same one at connect (the tcp landing's challenge)
        options = {**self._options, "secret": channel.data_key}
        self._links[dst_rank] = self._transport.open(msg.description, options)
        self._channels[dst_rank] = channel
        self._slots[dst_rank] = msg.next_slot
        self._algorithms[dst_rank] = msg.checksum
        if msg.in_place:  # its regions are its buffers, one each, in layout order: runs placed once per connection
            offsets, _ = region_offsets(self.dst, dst_rank)
            starts = sorted(offsets.values())
            self._in_place[dst_rank] = [[(s, i, d - starts[i], n) for s, d, n in runs for i in [bisect.bisect_right(starts, d) - 1]]
                                        for _, runs in self._runs[dst_rank]]
        else:
            self._in_place.pop(dst_rank, None)
        self._held[dst_rank] = {}  # what its slots hold is unknown until a version of ours goes live there
        if self._changes is not None and msg.inbox is not None:
            self._inboxes[dst_rank] = (self._transport.open(msg.inbox, options), msg.inbox_offset, msg.inbox_capacity)

    def _drop(self, dst_rank: int) -> None:
        link, channel = self._links.pop(dst_rank, None), self._channels.pop(dst_rank, None)
        inbox = self._inboxes.pop(dst_rank, None)
        for one in (link, None if inbox is None else inbox[0]):
            try:
                if one is not None:
                    one.close()
            except Exception:  # noqa: BLE001 - the peer is gone; nothing to release cleanly
                pass
        if channel is not None:
            channel.close()

    def complete(self, version: int, progress: Callable[[int], None] | None = None, *, canary: Canary | None = None) -> None:
        """Send this rank's part of ``version`` to every reader and return once it is live on each.

        ``canary`` (``rlsync.Canary.of(model)``, the weights being sent): every engine checks it before the version
        serves and refuses the version (``CanaryError`` here) when its own log-probs deviate; the largest deviation
        an engine reported is ``last_canary_deviation`` afterwards."""
        started = time.perf_counter()
        sent, failed = self._write_parts(version, progress, canary, notify=True)
        self._confirm(version, progress, canary, sent, failed, started)

    def _write_parts(self, version: int, progress: Callable[[int], None] | None, canary: Canary | None, *,
                     notify: bool) -> tuple[list[int], dict[int, str]]:
        """Write this rank's part of ``version`` to every reader (at once); with ``notify``, each reader's Done follows
        its bytes, else the Dones wait in ``_unsent`` for ``_notify`` (a relay that makes every reader of a host take
        its bytes before any reader hears of the version). The readers written to, and why the others failed."""
        missing = sorted(self._needed - self._sources.keys())
        if missing:
            raise WeightMismatchError(f"writer rank {self.rank}: no tensor was put for {missing[:5]} (and {max(0, len(missing) - 5)} more)")
        names = sorted(self._sources)
        self._plugins.hook.rlsync_before_export(version=version, names=names)
        self._ready = ready_events(self._streams.streams())
        self._streams.clear()
        wait_ready(self._ready)  # this thread's own reads of the sources (the delta's) after the streams that made them
        self.last_delta_seconds = 0.0
        if self._changes is not None:
            self._staging.wait()  # the delta reads every buffer first
            found = time.perf_counter()
            self._changes.record(version, self._sources | self._delta_sources)
            self.last_delta_seconds += time.perf_counter() - found
        self._sent = {}
        self.last_digests = {}
        failed: dict[int, str] = {}
        self._unsent = {}
        if len(self._runs) > 1:  # readers get their parts at once: publishing to N readers costs ~one reader
            with ThreadPoolExecutor(len(self._runs), thread_name_prefix=f"rlsync-writer-{self.rank}") as pool:
                outcomes = list(pool.map(lambda r: self._post(r, version, progress, canary, notify=notify), self._runs))
        else:
            outcomes = [self._post(r, version, progress, canary, notify=notify) for r in self._runs]
        self._staging.wait()
        sent = [r for r, error in zip(self._runs, outcomes) if error is None]
        failed.update({r: error for r, error in zip(self._runs, outcomes) if error is not None})
        return sent, failed

    def _notify(self) -> None:
        """Send the Dones ``_write_parts(notify=False)`` kept back."""
        unsent, self._unsent = self._unsent, {}
        for dst_rank, done in unsent.items():
            self._channels[dst_rank].send(done)

    def _confirm(self, version: int, progress: Callable[[int], None] | None, canary: Canary | None, sent: list[int],
                 failed: dict[int, str], started: float) -> None:
        """Wait for every notified reader's answer; raise unless ``version`` is live on all of them."""
        deviations: list[float] = []
        deadline = time.monotonic() + self.timeout
        for dst_rank in sent:
            channel = self._channels[dst_rank]
            try:
                got = channel.recv(timeout_ms=int(max(0.0, deadline - time.monotonic()) * 1000))
                if got is not None and isinstance(got[1], Refuse) and got[1].kind == "delta":  # it cannot take our delta
                    resent = self._post(dst_rank, version, progress, canary, full=True)
                    got = None if resent is not None else channel.recv(timeout_ms=int(max(0.0, deadline - time.monotonic()) * 1000))
            except TransportError as exc:  # an answer that is not one (BadFrame): this reader failed, the others go on
                failed[dst_rank] = str(exc)
                self._drop(dst_rank)
                continue
            if got is None:
                failed[dst_rank] = f"did not confirm version {version} within {self.timeout} s (it may have died)"
                self._drop(dst_rank)
                continue
            msg = got[1]
            if isinstance(msg, Ack) and msg.version == version:
                mine = self.last_digests.get(dst_rank)
                if msg.digest is not None and mine is not None and msg.digest != mine:
                    raise VersionError(f"reader rank {dst_rank} made version {version} live with digest {msg.digest}, but "
                                       f"this writer sent digest {mine}: the engine serves other bytes under that version")
                self._held[dst_rank][self._slots[dst_rank]] = version
                self._slots[dst_rank] = msg.next_slot
                if msg.canary_deviation is not None:
                    deviations.append(msg.canary_deviation)
            elif isinstance(msg, Refuse) and msg.kind == "canary":
                raise CanaryError(f"reader rank {dst_rank}: {msg.reason}")
            elif isinstance(msg, Refuse) and msg.kind in ("version", "restart"):
                raise VersionError(f"reader rank {dst_rank} refused version {version}: {msg.reason}")
            elif isinstance(msg, Refuse) and msg.kind == "checksum":
                raise WeightMismatchError(f"reader rank {dst_rank}: {msg.reason}")
            else:
                failed[dst_rank] = getattr(msg, "reason", f"unexpected answer {msg!r}")
        if failed:
            ok = [r for r in sent if r not in failed]
            detail = "; ".join(f"reader rank {r} ({self._readers[r]}): {why}" for r, why in sorted(failed.items()))
            error = TransferTimeoutError if all("did not confirm" in why for why in failed.values()) else PeerLostError
            raise error(f"version {version} is not live everywhere: {detail}. Live on reader ranks {ok}.")
        self.last_bytes = sum(self._sent.values())
        self.last_canary_deviation = max(deviations) if deviations else None
        stats: dict[str, Any] = {"bytes": self.last_bytes, "seconds": time.perf_counter() - started}
        if self.last_canary_deviation is not None:
            stats["canary_deviation"] = self.last_canary_deviation
        self._plugins.hook.rlsync_after_export(version=version, stats=stats)

    def _delta_for(self, dst_rank: int, slot: int) -> tuple[int, torch.Tensor] | None:
        """``(base version, encoded delta)`` of this rank's part of ``dst_rank``, if one fits. The base is the newest
        version the reader holds of this part, in whichever slot: when it is not ``slot`` (two slots, the live one
        the other), the reader first copies it into ``slot``, locally, so a delta carries one step, not two."""
        held = self._held[dst_rank]
        if self._changes is None or not held or dst_rank not in self._inboxes:
            return None
        base = max(held.values())
        groups = self._runs[dst_rank]
        changed = {name: self._changes.since(base, name) for name, _ in groups}
        flips = {name: self._changes.flips(base, name) for name, _ in groups}
        capacity = min(self._inboxes[dst_rank][2], self._part_bytes[dst_rank] - 1)  # smaller than a full send, or none
        started = time.perf_counter()
        payload = encode_delta(groups, changed, self._sources | self._delta_sources, self._itemsizes, capacity, flips,
                               self._transport.compress_deltas)
        self.last_delta_seconds += time.perf_counter() - started  # summed over readers (pool threads: an upper bound)
        return None if payload is None else (base, payload)

    def _post(self, dst_rank: int, version: int, progress: Callable[[int], None] | None, canary: Canary | None,
              full: bool = False, notify: bool = True) -> str | None:
        """Write this rank's part of ``version`` to one reader and notify it; the error, if any."""
        try:
            self._connect(dst_rank)
            link, slot = self._links[dst_rank], self._slots[dst_rank]
            delta = None if full else self._delta_for(dst_rank, slot)
            self._held[dst_rank].pop(slot, None)  # overwritten from here on
            placed = self._in_place.get(dst_rank)
            if placed is not None:
                refused = self._ask_to_begin(dst_rank, version)
                if refused is not None:
                    return refused
            checksums = Checksums(self._algorithms[dst_rank]) if self._checksum else None
            wait_ready(self._ready)  # this thread's stream after the trainer's, on which the device sources were made
            into = placed if placed is not None else self._slotted(dst_rank, slot)  # each group's runs, as written
            for group, (name, runs) in enumerate(self._runs[dst_rank]):
                self._staging.wait(name)  # its device-to-host copy, if put() issued one
                source = self._sources[name]
                if delta is None:
                    link.write(self._link_source(source), into[group])
                if checksums is not None:  # over the whole part: what the slot must hold, however it got there
                    checksums.add(name, (source[s : s + n] for s, _, n in runs))
                if progress is not None:
                    progress(sum(n for _, _, n in runs))
            nbytes = 0 if delta is None else delta[1].numel()
            if delta is not None and nbytes:
                inbox, offset, _ = self._inboxes[dst_rank]
                staging = self._inbox_source(dst_rank, delta[1])
                inbox.write(self._link_source(staging), [(0, 0, offset, nbytes)])
                inbox.flush()
            link.flush()
            self._sent[dst_rank] = nbytes if delta is not None else self._part_bytes[dst_rank]
            if checksums is not None:
                self.last_digests[dst_rank] = digest({self.rank: checksums.values})
            done = Done(self.rank, version, slot, None if checksums is None else checksums.values,
                        delta_base=None if delta is None else delta[0], delta_nbytes=nbytes, canary=canary)
            if notify:
                self._channels[dst_rank].send(done)
            else:
                self._unsent[dst_rank] = done
        except TransportError as exc:
            self._drop(dst_rank)
            return str(exc)
        return None

    def _slotted(self, dst_rank: int, slot: int) -> list[list[Run]]:
        """``dst_rank``'s runs, group by group, as written into ``slot``: built once per slot, not per version (a
        model's 1600 tensors cost a millisecond a version to rebuild them)."""
        key = (dst_rank, slot)
        if key not in self._slot_runs:
            self._slot_runs[key] = [[(s, slot, d, n) for s, d, n in runs] for _, runs in self._runs[dst_rank]]
        return self._slot_runs[key]

    def _ask_to_begin(self, dst_rank: int, version: int) -> str | None:
        """An in-place reader pauses its engine before a byte lands (a node relay asks its readers too): ask, and
        wait for its go."""
        channel = self._channels[dst_rank]
        channel.send(Begin(self.rank, version))
        got = channel.recv(timeout_ms=int(self.timeout * 1000))
        if got is None:
            self._drop(dst_rank)
            return f"did not let version {version} begin within {self.timeout} s (gone, or an in-place engine that did not pause)"
        if isinstance(got[1], Go) and got[1].version == version:
            return None
        if isinstance(got[1], Refuse) and got[1].kind == "version":
            raise VersionError(f"reader rank {dst_rank} refused version {version}: {got[1].reason}")
        return getattr(got[1], "reason", f"unexpected answer {got[1]!r}")

    def _link_source(self, source: torch.Tensor) -> Any:
        """What a link's ``write`` takes: host bytes as a numpy array, device bytes as the tensor."""
        return source.numpy() if source.device.type == "cpu" else source

    def _inbox_source(self, dst_rank: int, payload: torch.Tensor) -> torch.Tensor:
        """``payload`` copied into ``dst_rank``'s inbox staging buffer (allocated once, at the inbox's capacity, on
        the payload's device where the transport reads device memory, else on the host), so that transports that
        register memory register it once."""
        device = payload.device if self._transport.device_sources else torch.device("cpu")
        staging = self._inbox_staging.get(dst_rank)
        if staging is None or staging.device != device:
            staging = self._inbox_staging[dst_rank] = torch.empty(self._inboxes[dst_rank][2], dtype=torch.uint8, device=device)
        staging[: payload.numel()].copy_(payload)
        return staging

    def close(self) -> None:
        for dst_rank in list(self._links):
            self._drop(dst_rank)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
