"""Weight sync: ``WeightsWriter`` (trainer rank) puts tensors and completes versions;
``WeightsReader`` (engine rank) receives them, and a version goes live only when all its bytes
have landed.

Both sides build the same plan from the same two layouts, so nothing but fingerprints, region
descriptions and version notices crosses the control plane. Landing:

* ``direct``: the regions are the engine's parameter memory. Two slots: a version is written
  into the slot not being served, then the reader flips. A writer dying midway leaves the served
  slot untouched.
* ``staged``: one staging slot; when a version is complete the reader hands views of it to
  ``on_version`` (the engine's loader, a local copy) before the version counts as live.

A writer built with ``wire="delta"`` sends, where it can, only the values that changed since the
version its part of the target slot holds (``rlsync.core._delta``): into an inbox the reader
allocates for it, from which the reader writes them into the slot. It sends in full when it does
not know what the slot holds, or when the delta would not fit the inbox.
"""

from __future__ import annotations

import secrets
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import pluggy

from rlsync.core import _plugins
from rlsync.core._control import (
    Ack,
    AskLayout,
    Channel,
    Done,
    Hello,
    LayoutIs,
    Refuse,
    Welcome,
    bind_router,
    connect_dealer,
)
from rlsync.core._builders import replicated
from rlsync.core._delta import INBOX_SHARE, ChangeLog, apply as apply_delta, encode as encode_delta
from rlsync.core._errors import (
    ConfigError,
    PeerLostError,
    RlsyncError,
    TransferTimeoutError,
    TransportError,
    VersionError,
    WeightMismatchError,
)
from rlsync.core._layout import Layout, dtype_size, tensor_fingerprints
from rlsync.core._planner import Plan, build_plan
from rlsync.core._transfer import Transfer
from rlsync.core._transport import Landing as TransportLanding
from rlsync.core._transport import Link, Transport

ALIGN = 64
Landing = Literal["direct", "staged"]
#: what a writer may put on the wire (``WeightsWriter(wire=...)``)
WIRES = ("full", "delta", "fp8", "fp8+delta")


def region_offsets(layout: Layout, rank: int) -> tuple[dict[str, int], int]:
    """Byte offset of each of ``rank``'s buffers inside its landing region, and the region size."""
    offsets: dict[str, int] = {}
    at = 0
    for b in layout.buffers:
        if b.rank == rank:
            offsets[b.name] = at
            at += -(-(b.numel * dtype_size(b.dtype)) // ALIGN) * ALIGN
    return offsets, at


def _resolve(transport: str | type[Transport], pm: pluggy.PluginManager | None) -> type[Transport]:
    if isinstance(transport, str):
        cls: type[Transport] = _plugins.transports(pm).get(transport)  # type: ignore[assignment]  # registered classes
    else:
        cls = transport
    if not cls.available():
        raise TransportError(f"transport {cls.name!r} cannot run here; install its extra (pip install 'rlsync[{cls.name}]') or pick another")
    return cls


def _runs_by_pair(transfers: Iterable[Transfer], offsets: Mapping[str, int]) -> dict[tuple[int, int], list[tuple[str, list[tuple[int, int, int]]]]]:
    """``{(src_rank, dst_rank): [(src_buffer, [(src_off, region_off, nbytes), ...]), ...]}`` in plan order,
    adjacent runs merged."""
    out: dict[tuple[int, int], list[tuple[str, list[tuple[int, int, int]]]]] = {}
    for t in transfers:
        groups = out.setdefault((t.src_rank, t.dst_rank), [])
        if not groups or groups[-1][0] != t.src_buffer:
            groups.append((t.src_buffer, []))
        runs = groups[-1][1]
        base = offsets[t.dst_buffer]
        for s, d, n in t.runs():
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == base + d:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((s, base + d, n))
    return out


def _crc(chunks: Iterable[np.ndarray], value: int = 0) -> int:
    """CRC-32 over the chunks in order, continuing from ``value``."""
    for chunk in chunks:
        value = zlib.crc32(chunk.data, value)
    return value


class WeightsReader:
    """Engine side of one rank: receives versions into transport memory; see the module docstring.

    ``address`` is what writers connect to. ``version`` is the newest live version (-1: none).
    ``on_version(version, buffers)`` runs in the reader's service thread when a version's bytes
    have all landed, before it goes live; ``buffers`` maps buffer names to ``uint8`` arrays.
    If it raises, the version is refused and the previous one stays live. ``on_refused(version,
    reason)`` runs when a complete version is refused before that (its checksums did not match).
    """

    def __init__(
        self,
        src: Layout | None,
        dst: Layout | None,
        rank: int,
        *,
        replicas: int | None = None,
        transport: str | type[Transport] = "shm",
        landing: Landing = "direct",
        host: str = "127.0.0.1",
        port: int = 0,
        secret: str | None = None,
        checksum: bool = False,
        on_version: Callable[[int, dict[str, np.ndarray]], None] | None = None,
        on_refused: Callable[[int, str], None] | None = None,
        transport_options: dict[str, Any] | None = None,
        plugins: pluggy.PluginManager | None = None,
    ) -> None:
        if landing not in ("direct", "staged"):
            raise ValueError(f"landing must be 'direct' or 'staged', not {landing!r}")
        if dst is None and (replicas is None or replicas < 1 or src is not None):
            raise ConfigError("WeightsReader needs its destination layout, or dst=None with replicas=N (N readers "
                              "that each hold a whole copy of what the writers send, learned from their layout)")
        self.rank = rank
        self.landing_mode = landing
        self.replicas = replicas
        self.dst: Layout | None = None
        self.plan: Plan | None = None
        self._expected: set[int] = set()
        self._pair_runs: dict[tuple[int, int], list[tuple[str, list[tuple[int, int, int]]]]] = {}
        self._tensors_of: dict[tuple[int, str], str] = {}  # (writer rank, its buffer) -> the tensor it holds
        self._transport = _resolve(transport, plugins)
        self._transport_options = transport_options
        self._landing: TransportLanding | None = None
        if dst is not None:
            self._set_dst(dst)
        if src is not None:
            self._adopt(src)
        self._checksum = checksum
        self._on_version = on_version
        self._on_refused = on_refused
        self._channel, self.address = bind_router(host, port, secret)
        self._live_slot = 0
        self._target_slot = 1 if landing == "direct" else 0
        self._version = -1
        self._pending_version: int | None = None
        self._done: dict[int, tuple[bytes, Done]] = {}
        self._sessions: dict[int, tuple[str, int]] = {}  # writer rank -> (session, epoch it started in)
        self._epoch = 0  # counts writer restarts
        self.discarded: list[int] = []  # unfinished versions given up because a writer restarted
        self._held: dict[int, dict[int, int]] = {}  # writer rank -> {slot: the version its part of that slot holds}
        self._inbox: TransportLanding | None = None  # where delta writers put their deltas
        self._inbox_parts: dict[int, tuple[int, int]] = {}  # writer rank -> (offset, capacity) in the inbox
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"rlsync-reader-{rank}", daemon=True)
        self._thread.start()

    def _set_dst(self, dst: Layout) -> None:
        """Receive into ``dst``: this rank's buffers and their landing memory."""
        self.dst = dst
        self._dst_fingerprint = dst.fingerprint()
        self._dst_tensors = tensor_fingerprints(dst)
        self._offsets, self._nbytes = region_offsets(dst, self.rank)
        self._sizes = {b.name: b.numel * dtype_size(b.dtype) for b in dst.buffers if b.rank == self.rank}
        slots = 2 if self.landing_mode == "direct" else 1
        self._landing = self._transport.landing(self._nbytes, slots, self._transport_options)

    def _adopt(self, src: Layout) -> None:
        """Build this rank's plan from the writers' layout ``src``."""
        assert self.dst is not None
        self.plan = build_plan(src, self.dst, dst_ranks=[self.rank])
        self._expected = {t.src_rank for t in self.plan.transfers}
        self._pair_runs = _runs_by_pair(self.plan.transfers, self._offsets)
        self._tensors_of = {(t.src_rank, t.src_buffer): t.tensor for t in self.plan.transfers}

    # -- what the engine uses --------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    def buffers(self, slot: int | None = None) -> dict[str, np.ndarray]:
        """``uint8`` views of this rank's buffers in ``slot`` (default: the live one)."""
        if self._landing is None:
            return {}
        region = self._landing.regions[self._live_slot if slot is None else slot]
        return {name: region[off : off + self._sizes[name]] for name, off in self._offsets.items()}

    def wait_for_version(self, version: int | None = None, timeout: float | None = None) -> int:
        """Block until ``version`` (default: any version newer than now) is live; return the live version."""
        target = self._version + 1 if version is None else version
        with self._cond:
            if not self._cond.wait_for(lambda: self._version >= target or self._closed.is_set(), timeout):
                raise TransferTimeoutError(f"reader rank {self.rank}: version {target} did not arrive within {timeout} s")
        return self._version

    def get(self, name: str, out: np.ndarray) -> None:
        """Copy buffer ``name`` of the live version into the caller-owned ``out`` (any dtype, same bytes)."""
        self.multi_get({name: out})

    def multi_get(self, outs: Mapping[str, np.ndarray]) -> None:
        with self._cond:
            live = self.buffers()
            for name, out in outs.items():
                if name not in live:
                    raise WeightMismatchError(f"reader rank {self.rank} has no buffer {name!r}; it has {sorted(live)[:5]}...")
                target = out.reshape(-1).view(np.uint8)
                if target.nbytes != live[name].nbytes:
                    raise WeightMismatchError(f"buffer {name!r}: {live[name].nbytes} bytes, but the destination has {target.nbytes}")
                np.copyto(target, live[name])

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

    def _serve(self) -> None:
        while not self._closed.is_set():
            if self._landing is not None:
                self._landing.progress()
            got = self._channel.recv(timeout_ms=20)
            if got is None:
                continue
            identity, msg = got
            assert identity is not None  # ROUTER sockets always prefix the sender's identity
            if isinstance(msg, Hello):
                self._hello(identity, msg)
            elif isinstance(msg, AskLayout):
                self._layout_asked(identity, msg)
            elif isinstance(msg, Done):
                self._finish_part(identity, msg)

    def _replicate(self, src: Layout | None) -> None:
        """A replica reader (``dst=None, replicas=N``) holds a whole copy of the writers' tensors."""
        if self.dst is None and src is not None and self.replicas is not None:
            self._set_dst(replicated(src.tensors, tuple(range(self.replicas))))
            self._adopt(src)

    def _layout_asked(self, identity: bytes, msg: AskLayout) -> None:
        self._replicate(msg.src)
        if self.dst is None:
            self._channel.send(Refuse(f"reader rank {self.rank} learns its layout from the writers: ask with yours"), identity)
            return
        self._channel.send(LayoutIs(self.dst, self._version), identity)

    def _hello(self, identity: bytes, msg: Hello) -> None:
        self._replicate(msg.src)
        if self.plan is None and self.dst is not None and msg.src is not None and msg.dst_fingerprint == self._dst_fingerprint:
            try:
                self._adopt(msg.src)
            except RlsyncError as exc:
                self._channel.send(Refuse(f"reader rank {self.rank} cannot receive from the writers' layout: {exc}"), identity)
                return
        if self.plan is None or self._landing is None:
            self._channel.send(Refuse(f"reader rank {self.rank} was built without the writers' layout and the writer "
                                      f"sent none: give WeightsReader the source layout"), identity)
            return
        if msg.dst_fingerprint != self._dst_fingerprint or msg.src_fingerprint != self.plan.src_fingerprint:
            side, theirs, ours = (
                ("destination", msg.dst_tensors, self._dst_tensors)
                if msg.dst_fingerprint != self._dst_fingerprint
                else ("source", {}, {})
            )
            first = next((n for n in [*ours, *theirs] if ours.get(n) != theirs.get(n)), None)
            detail = f" first differing tensor: {first!r}" if first else ""
            reason = f"writer and reader rank {self.rank} were built with different {side} layouts;{detail}. Build both from the same layouts."
            self._channel.send(Refuse(reason), identity)
            return
        previous = self._sessions.get(msg.writer_rank)
        if previous is not None and previous[0] != msg.session:
            self._epoch += 1
            self._discard_partners(msg.writer_rank, previous[1])
        self._sessions[msg.writer_rank] = (msg.session, self._epoch)
        self._done.pop(msg.writer_rank, None)  # a writer that reconnects starts its version over
        self._held.get(msg.writer_rank, {}).pop(self._target_slot, None)  # it may have written part of the slot
        welcome = Welcome(self.rank, self._transport.name, self._landing.describe(), self._version, self._target_slot)
        if msg.delta:
            inbox = self._open_inbox()
            welcome.inbox = inbox.describe()
            welcome.inbox_offset, welcome.inbox_capacity = self._inbox_parts.get(msg.writer_rank, (0, 0))
        self._channel.send(welcome, identity)

    def _open_inbox(self) -> TransportLanding:
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
        if msg.version <= self._version:
            self._channel.send(Refuse(f"version {msg.version} is not newer than live version {self._version}", "version"), identity)
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
        if error is None and self._on_version is not None:
            try:
                self._on_version(msg.version, self.buffers(self._target_slot))
            except Exception as exc:  # noqa: BLE001 - reported to every writer, version stays out
                error = f"the engine failed to load version {msg.version}: {exc!r}"
        if error is not None:
            for ident, _ in done.values():
                self._channel.send(Refuse(error, kind), ident)
            return
        for writer in done:
            self._held.setdefault(writer, {})[self._target_slot] = msg.version
        with self._cond:
            if self.landing_mode == "direct":
                self._live_slot, self._target_slot = self._target_slot, self._live_slot
            self._version = msg.version
            self._cond.notify_all()
        for ident, _ in done.values():
            self._channel.send(Ack(msg.version, self._target_slot), ident)

    def _land_delta(self, msg: Done, held: int | None) -> str | None:
        """Write a writer's delta from its inbox part into the target slot; what went wrong, if anything."""
        offset, capacity = self._inbox_parts.get(msg.writer_rank, (0, 0))
        if self._inbox is None or msg.delta_nbytes > capacity:
            return f"reader rank {self.rank} has no inbox of {msg.delta_nbytes} bytes for writer rank {msg.writer_rank}: send in full"
        if held != msg.delta_base:
            return (f"writer rank {msg.writer_rank} sent a delta against version {msg.delta_base}, but its part of slot "
                    f"{msg.slot} on reader rank {self.rank} holds {'unknown bytes' if held is None else f'version {held}'}: send in full")
        assert self._landing is not None
        try:
            apply_delta(self._inbox.regions[0][offset : offset + msg.delta_nbytes], self._landing.regions[msg.slot])
        except ValueError as exc:
            return f"reader rank {self.rank}: a bad delta from writer rank {msg.writer_rank} ({exc}): send in full"
        return None

    def _verify(self, done: Mapping[int, tuple[bytes, Done]]) -> str | None:
        """Each writer's per-buffer CRC-32 against the bytes that landed; the first mismatch, named."""
        assert self.plan is not None and self._landing is not None
        region = self._landing.regions[self._target_slot]
        for writer, (_, msg) in done.items():
            got: dict[str, int] = {}  # per source buffer, over its runs in plan order (as the writer computed it)
            for buffer, runs in self._pair_runs.get((writer, self.rank), []):
                got[buffer] = _crc((region[d : d + n] for _, d, n in runs), got.get(buffer, 0))
            for buffer, value in got.items():
                sent = None if msg.checksums is None else msg.checksums.get(buffer)
                if sent != value:
                    tensor = self._tensors_of.get((writer, buffer), buffer)
                    return (f"checksum mismatch in tensor {tensor!r} (from writer rank {writer}) for version {msg.version}: "
                            f"what landed differs from what was sent; version refused, the previous one stays live")
        return None


class WeightsWriter:
    """Trainer side of one rank: ``put``/``multi_put`` this rank's buffers, then ``complete(version)``.

    ``readers`` maps each destination rank to its reader's ``address``. ``dst=None`` asks the
    first reader for the destination layout (readers know it: an engine derives it from its own
    loader), so a trainer needs nothing but its own layout and the addresses; tensors of ``src``
    that the destination does not hold (a tied ``lm_head.weight``, say) are then simply not sent.

    ``complete`` sends this rank's part to every reader at once (one thread per reader), notifies
    them, and returns once each has the version live; a reader that does not confirm within
    ``timeout`` raises ``TransferTimeoutError`` naming it, after the others got the version.

    ``wire`` chooses what crosses (off by default: ``"full"``, every byte of every version):

    * ``"delta"``: only what changed since the version a reader's slot holds (see the module
      docstring); the writer keeps a copy of its last version's bytes to find the changes.
    * ``"fp8"``: for an engine that serves the fp8 block-quantized checkpoint format
      (``rlsync.wire``): ``src`` stays the trainer's layout, ``put`` takes the model-dtype tensors
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
        transport: str | type[Transport] = "shm",
        secret: str | None = None,
        checksum: bool = False,
        timeout: float = 60.0,
        transport_options: dict[str, Any] | None = None,
        plugins: pluggy.PluginManager | None = None,
        wire: str = "full",
    ) -> None:
        if wire not in WIRES:
            raise ConfigError(f"wire={wire!r}: use one of {', '.join(WIRES)}")
        self._quantized: dict[str, tuple[int, ...]] = {}  # fp8 on the wire: buffer -> the shape of the box it holds
        if "fp8" in wire:
            from rlsync.wire._fp8 import fp8_layout, is_quantized

            metas = src.tensor_map()
            self._quantized = {s.buffer: s.box.sizes for s in src.shards if s.rank == rank and is_quantized(s.tensor, metas[s.tensor].shape)}
            src = fp8_layout(src)
        delta = "delta" in wire
        self.rank = rank
        self._readers = dict(enumerate(readers)) if not isinstance(readers, Mapping) else dict(readers)
        self.next_version = 1  # with dst=None: the first reader's live version + 1
        if dst is None:
            if not self._readers:
                raise WeightMismatchError("WeightsWriter needs the readers' addresses to learn the destination layout")
            dst, live = _ask_layout(self._readers[min(self._readers)], src, secret, timeout)
            self.next_version = live + 1
        self.src, self.dst = src, dst
        plan = build_plan(src, dst)
        self.stats = plan.stats  # the whole plan's: bytes sent by all writer ranks, the busiest sender's share
        self._fingerprints = (plan.src_fingerprint, plan.dst_fingerprint, plan.dst_tensors)
        self._session = secrets.token_hex(8)
        mine = plan.for_src_rank(rank)
        self._runs: dict[int, list[tuple[str, list[tuple[int, int, int]]]]] = {}
        for dst_rank in sorted({t.dst_rank for t in mine}):
            if dst_rank not in self._readers:
                raise WeightMismatchError(f"writer rank {rank} sends to destination rank {dst_rank}, but no reader address was given for it")
            offsets, _ = region_offsets(dst, dst_rank)
            self._runs[dst_rank] = _runs_by_pair((t for t in mine if t.dst_rank == dst_rank), offsets)[(rank, dst_rank)]
        self._specs = {b.name: b for b in src.buffers if b.rank == rank}
        self._needed = {name for groups in self._runs.values() for name, _ in groups}
        self._transport = _resolve(transport, plugins)
        self._options = transport_options
        self._secret = secret
        self._checksum = checksum
        self.timeout = timeout
        self._plugins = plugins
        self._sources: dict[str, np.ndarray] = {}
        self._channels: dict[int, Channel] = {}
        self._links: dict[int, Link] = {}
        self._slots: dict[int, int] = {}
        self._part_bytes = {r: sum(n for _, runs in groups for _, _, n in runs) for r, groups in self._runs.items()}  # full send, per reader
        self.bytes_per_version = sum(self._part_bytes.values())
        self._itemsizes = {name: dtype_size(b.dtype) for name, b in self._specs.items()}
        self._changes = ChangeLog(self._itemsizes) if delta else None
        self._inboxes: dict[int, tuple[Link, int, int, np.ndarray]] = {}  # reader rank -> (link, offset, capacity, staging)
        self._held: dict[int, dict[int, int]] = {}  # reader rank -> {slot: version this rank's part of it holds}
        self._sent: dict[int, int] = {}  # reader rank -> bytes the last version moved to it
        self.last_bytes = 0

    def put(self, name: str, tensor: Any) -> None:
        """Bind this rank's buffer ``name`` (for plain and FSDP layouts: the parameter name) to ``tensor``.

        The tensor is read when ``complete`` runs: keep it alive and unchanged until then.
        """
        if name in self._quantized:  # fp8 on the wire: the weight and its block scales
            from rlsync.wire._fp8 import SCALE_SUFFIX, quantize

            if str(getattr(tensor, "dtype", "")) == "torch.float8_e4m3fn":
                raise WeightMismatchError(f"tensor {name!r} is already fp8: with wire='fp8' put the model-dtype weight; "
                                          f"rlsync quantizes it (with its {name + SCALE_SUFFIX!r})")
            if tuple(tensor.shape) != self._quantized[name]:
                raise WeightMismatchError(f"tensor {name!r}: shape {tuple(tensor.shape)}, but its shard is {self._quantized[name]}: "
                                          f"with wire='fp8' put the shard in its shape (its 128x128 blocks are quantized)")
            q, scale = quantize(tensor)
            self.put(name + SCALE_SUFFIX, scale)
            tensor = q
        spec = self._specs.get(name)
        if spec is None:
            near = sorted(self._specs)[:5]
            raise WeightMismatchError(f"writer rank {self.rank} has no buffer {name!r} in its layout; it has e.g. {near}")
        if self._plugins is not None:
            changed = self._plugins.hook.rlsync_transform_tensor(name=name, tensor=tensor, version=-1)
            tensor = tensor if changed is None else changed
        dtype = str(getattr(tensor, "dtype", "")).removeprefix("torch.")
        if dtype != spec.dtype:
            raise WeightMismatchError(f"tensor {name!r}: dtype {dtype} but the layout says {spec.dtype}; cast it before put()")
        numel = int(tensor.numel()) if callable(getattr(tensor, "numel", None)) else int(tensor.size)
        if numel != spec.numel:
            raise WeightMismatchError(f"tensor {name!r}: {numel} elements but the layout says {spec.numel} (shape {tuple(tensor.shape)})")
        self._sources[name] = _as_bytes(name, tensor)

    def multi_put(self, tensors: Mapping[str, Any]) -> None:
        for name, tensor in tensors.items():
            self.put(name, tensor)

    def _connect(self, dst_rank: int) -> None:
        if dst_rank in self._links:
            return
        channel = connect_dealer(self._readers[dst_rank], self._secret)
        src_fp, dst_fp, dst_tensors = self._fingerprints
        channel.send(Hello(self.rank, src_fp, dst_fp, dst_tensors, self._session, self.src, delta=self._changes is not None))
        got = channel.recv(timeout_ms=int(self.timeout * 1000))
        if got is None:
            channel.close()
            raise TransferTimeoutError(f"reader rank {dst_rank} at {self._readers[dst_rank]} did not answer within {self.timeout} s")
        msg = got[1]
        if isinstance(msg, Refuse):
            channel.close()
            raise WeightMismatchError(f"reader rank {dst_rank} refused: {msg.reason}")
        assert isinstance(msg, Welcome)
        if msg.transport != self._transport.name:
            channel.close()
            raise TransportError(f"reader rank {dst_rank} uses transport {msg.transport!r}, this writer {self._transport.name!r}")
        self._links[dst_rank] = self._transport.open(msg.description, self._options)
        self._channels[dst_rank] = channel
        self._slots[dst_rank] = msg.next_slot
        self._held[dst_rank] = {}  # what its slots hold is unknown until a version of ours goes live there
        if self._changes is not None and msg.inbox is not None:
            staging = np.empty(msg.inbox_capacity, np.uint8)  # one buffer per reader, registered once with the transport
            self._inboxes[dst_rank] = (self._transport.open(msg.inbox, self._options), msg.inbox_offset, msg.inbox_capacity, staging)

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

    def complete(self, version: int, progress: Callable[[int], None] | None = None) -> None:
        """Send this rank's part of ``version`` to every reader and return once it is live on each."""
        missing = sorted(self._needed - self._sources.keys())
        if missing:
            raise WeightMismatchError(f"writer rank {self.rank}: no tensor was put for {missing[:5]} (and {max(0, len(missing) - 5)} more)")
        names = sorted(self._sources)
        if self._plugins is not None:
            self._plugins.hook.rlsync_before_export(version=version, names=names)
        started = time.perf_counter()
        if self._changes is not None:
            self._changes.record(version, self._sources)
        self._sent = {}
        failed: dict[int, str] = {}
        if len(self._runs) > 1:  # readers get their parts at once: publishing to N readers costs ~one reader
            with ThreadPoolExecutor(len(self._runs), thread_name_prefix=f"rlsync-writer-{self.rank}") as pool:
                outcomes = list(pool.map(lambda r: self._post(r, version, progress), self._runs))
        else:
            outcomes = [self._post(r, version, progress) for r in self._runs]
        sent = [r for r, error in zip(self._runs, outcomes) if error is None]
        failed.update({r: error for r, error in zip(self._runs, outcomes) if error is not None})
        deadline = time.monotonic() + self.timeout
        for dst_rank in sent:
            channel = self._channels[dst_rank]
            remaining = max(0.0, deadline - time.monotonic())
            got = channel.recv(timeout_ms=int(remaining * 1000))
            if got is not None and isinstance(got[1], Refuse) and got[1].kind == "delta":  # it cannot take our delta
                resent = self._post(dst_rank, version, progress, full=True)
                got = None if resent is not None else channel.recv(timeout_ms=int(max(0.0, deadline - time.monotonic()) * 1000))
            if got is None:
                failed[dst_rank] = f"did not confirm version {version} within {self.timeout} s (it may have died)"
                self._drop(dst_rank)
                continue
            msg = got[1]
            if isinstance(msg, Ack) and msg.version == version:
                self._held[dst_rank][self._slots[dst_rank]] = version
                self._slots[dst_rank] = msg.next_slot
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
        if self._plugins is not None:
            self._plugins.hook.rlsync_after_export(
                version=version, stats={"bytes": self.last_bytes, "seconds": time.perf_counter() - started}
            )

    def _delta_for(self, dst_rank: int, slot: int) -> tuple[int, np.ndarray] | None:
        """``(base version, encoded delta)`` of this rank's part for what ``slot`` of ``dst_rank`` holds, if one fits."""
        base = self._held[dst_rank].get(slot)
        if self._changes is None or base is None or dst_rank not in self._inboxes:
            return None
        groups = self._runs[dst_rank]
        changed = {name: self._changes.since(base, name) for name, _ in groups}
        capacity = min(self._inboxes[dst_rank][2], self._part_bytes[dst_rank] - 1)  # smaller than a full send, or none
        payload = encode_delta(groups, changed, self._sources, self._itemsizes, capacity)
        return None if payload is None else (base, payload)

    def _post(self, dst_rank: int, version: int, progress: Callable[[int], None] | None, full: bool = False) -> str | None:
        """Write this rank's part of ``version`` to one reader and notify it; the error, if any."""
        try:
            self._connect(dst_rank)
            link, slot = self._links[dst_rank], self._slots[dst_rank]
            delta = None if full else self._delta_for(dst_rank, slot)
            self._held[dst_rank].pop(slot, None)  # overwritten from here on
            crcs: dict[str, int] = {}
            for name, runs in self._runs[dst_rank]:
                source = self._sources[name]
                if delta is None:
                    link.write(source, [(s, slot, d, n) for s, d, n in runs])
                if self._checksum:  # over the whole part: what the slot must hold, however it got there
                    crcs[name] = _crc((source[s : s + n] for s, _, n in runs), crcs.get(name, 0))
                if progress is not None:
                    progress(sum(n for _, _, n in runs))
            if delta is not None and len(delta[1]):
                inbox, offset, _, staging = self._inboxes[dst_rank]
                staging[: len(delta[1])] = delta[1]
                inbox.write(staging, [(0, 0, offset, len(delta[1]))])
                inbox.flush()
            link.flush()
            self._sent[dst_rank] = len(delta[1]) if delta is not None else self._part_bytes[dst_rank]
            self._channels[dst_rank].send(Done(self.rank, version, slot, crcs if self._checksum else None,
                                               delta_base=None if delta is None else delta[0],
                                               delta_nbytes=0 if delta is None else len(delta[1])))
        except TransportError as exc:
            self._drop(dst_rank)
            return str(exc)
        return None

    def close(self) -> None:
        for dst_rank in list(self._links):
            self._drop(dst_rank)

    def __enter__(self) -> WeightsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def reader_layout(address: str, *, secret: str | None = None, timeout: float = 60.0) -> Layout:
    """The destination layout the ``WeightsReader`` at ``address`` receives into (every rank's part).

    A writer built with ``dst=None`` asks for it; engines derive their layout from their own loader,
    so the trainer need not know it."""
    return _ask_layout(address, None, secret, timeout)[0]


def _ask_layout(address: str, src: Layout | None, secret: str | None, timeout: float) -> tuple[Layout, int]:
    """``(destination layout, live version)`` of the reader at ``address``; ``src`` lets a replica reader
    (``dst=None, replicas=N``) derive its layout from the writers'."""
    channel = connect_dealer(address, secret)
    try:
        channel.send(AskLayout(src))
        got = channel.recv(timeout_ms=int(timeout * 1000))
    finally:
        channel.close()
    if got is None:
        raise TransferTimeoutError(f"the reader at {address} did not answer within {timeout} s: is the engine up, "
                                   f"and is this its address?")
    msg = got[1]
    if isinstance(msg, Refuse):
        raise WeightMismatchError(f"the reader at {address} refused: {msg.reason}")
    if not isinstance(msg, LayoutIs):
        raise TransportError(f"the reader at {address} answered {type(msg).__name__} to a layout request")
    return msg.layout, msg.live_version


def _as_bytes(name: str, tensor: Any) -> np.ndarray:
    """A ``uint8`` view of a contiguous CPU tensor or numpy array (no copy)."""
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous:
            raise WeightMismatchError(f"tensor {name!r} is not contiguous; pass np.ascontiguousarray(...)")
        return tensor.reshape(-1).view(np.uint8)
    import torch

    if tensor.device.type != "cpu":
        raise TransportError(f"tensor {name!r} is on {tensor.device}; this transport reads CPU memory: move it or use a GPU-capable transport")
    if not tensor.is_contiguous():
        raise WeightMismatchError(f"tensor {name!r} is not contiguous; call .contiguous() before put()")
    return np.asarray(tensor.detach().reshape(-1).view(torch.uint8).numpy())

