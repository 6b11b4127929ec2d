"""``NodeRelay``: one landing per host for the engine ranks on it, so that a byte several of them need crosses the
host's link once.

Several engine ranks on one host often need the same bytes: engine replicas (data parallel) each hold the whole
model, tensor-parallel ranks each hold the norms and routers. Sent by the trainer's writers to each rank, those bytes
cross the host's link once per rank. A relay receives every tensor the host's engines hold, once (a
``WeightsReader`` of one rank holding each such tensor whole: the trainer's writers connect to ``address`` as to an
engine of one rank, ``dst=None`` learns that layout), and forwards each engine rank its part over the host's own
transport (shared memory, tested on CPU; on a GPU node ``cuda_ipc`` from the relay's host landing into the engines'
device memory, tested on an H100: tests/gpu/test_cuda_relay.py), planned from the relay's layout to each engine's as
the trainer's writers plan theirs.

The version goes live on every rank of the host or on none: the relay writes every local reader's bytes first, then
asks each whether it takes the version (``Begin``: a shared-memory write to a dead reader succeeds, only an answer
shows it is there), and only then tells any of them. A local reader that died or would refuse by then leaves every
rank on the previous version, and the relay refuses the version to the trainer's writers, which name it. One that
dies in the milliseconds between its answer and its confirmation, or whose engine refuses the version when it loads
it (its loader, its canary), leaves the others on the new version, and the error says why, as for a writer's
readers today. The relay's own version goes live after every local reader confirmed.

The trainer's canary, if the version came with one, goes with it to every engine, which checks it as it would the
trainer's own; the largest deviation they report is the relay's answer, and one that refuses refuses the host's.

What crosses the slow link is the relay's inbound version, so ``wire="delta"`` from the trainer applies there;
locally every version goes whole.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import pluggy
import torch

from rlsync.core.layouts import replicated
from rlsync.core._errors import ConfigError, PeerLostError, RlsyncError, WeightMismatchError
from rlsync.core.layouts import Layout, TensorMeta
from rlsync.core.sync._layout_exchange import reader_layout
from rlsync.core.sync._options import SyncOptions
from rlsync.core.sync._reader import WeightsReader
from rlsync.core.sync._memory import free_memory
from rlsync.core.sync._regions import as_tensor, region_offsets
from rlsync.core.sync._transport import Region
from rlsync.core.sync._writer import WeightsWriter


class NodeRelay:
    """One host's landing for its engines (see the module docstring).

    ``engines``: per engine on this host, the addresses of its readers, one per rank (what each engine's readers
    say, as a trainer would be given them). ``options``: the relay's side of the trainer's link (transport, ``host``
    and ``port`` to listen on, ``secret``, ``verify``, ``timeout``); ``local``: the host's own transport, to the
    engines' readers (default: shared memory). ``address`` is what the trainer's writers connect to, as to one
    engine of one rank. Engines whose readers learn their layout from their writer (``replicas=N``) learn it from
    the relay, which learns it from the trainer's writers: then ``rank`` and ``replicas`` say which of the trainer's
    replica readers the relay is (a framework whose writers send to N replica readers, some of them relays: verl),
    and ``replica_engines=True`` says the engines are such without asking them (they need not be up before the
    first version). ``last_forward_seconds``: the last version's local
    forwarding, from its first local byte to every local reader's confirmation.
    """

    def __init__(self, engines: Sequence[Sequence[str]], *, options: SyncOptions | None = None,
                 local: SyncOptions | None = None, plugins: pluggy.PluginManager | None = None,
                 rank: int = 0, replicas: int = 1, replica_engines: bool = False) -> None:
        if not engines or any(not addresses for addresses in engines):
            raise ConfigError("NodeRelay needs, per engine on this host, the addresses of its readers (one per rank)")
        if not 0 <= rank < replicas:
            raise ConfigError(f"NodeRelay rank={rank}, replicas={replicas}: a rank among the replicas, from 0")
        self._engines = [list(addresses) for addresses in engines]
        self._local, self._plugins = local or SyncOptions(transport="shm"), plugins
        # replica engines told as such are not asked: they may not be up yet (a framework starting them all at once)
        layouts = [None if replica_engines else _layout_of(addresses[0], self._local) for addresses in engines]
        self._writers: list[WeightsWriter] = []
        self.last_forward_seconds = 0.0
        if all(layout is None for layout in layouts):  # replica engines, which learn their layout from their writer:
            # so does the relay, from the trainer's, and its own writers teach the engines theirs at the first version
            self._reader = WeightsReader(None, None, rank, replicas=replicas, options=options, landing="direct",
                                         on_version=self._forward, plugins=plugins)
        elif (rank, replicas) != (0, 1):
            raise ConfigError("NodeRelay rank/replicas: for engines that learn their layout from their writers (replicas)")
        elif any(layout is None for layout in layouts):
            raise ConfigError("NodeRelay: some engines know their layout and some learn it from their writers (replicas):"
                              " relay engines of one kind")
        else:  # rank 0 holds, whole, every tensor any engine here holds
            union = replicated(_union([layout for layout in layouts if layout is not None]))
            _check_room(union)
            self._writers = [WeightsWriter(union, dst, 0, addresses, options=self._local, plugins=plugins)
                             for dst, addresses in zip(layouts, self._engines)]
            self._reader = WeightsReader(None, union, 0, options=options, landing="direct", on_version=self._forward,
                                         plugins=plugins)
        self.address = self._reader.address

    @property
    def version(self) -> int:
        """The newest version live on every engine rank of this host (-1: none yet)."""
        return self._reader.version

    def wait_for_version(self, version: int | None = None, timeout: float | None = None) -> int:
        return self._reader.wait_for_version(version, timeout)

    def _forward(self, version: int, buffers: dict[str, Region]) -> None:
        """The relay's version has landed: every local reader takes its bytes, then all are told at once."""
        started = time.perf_counter()
        layout = self._reader.dst
        assert layout is not None  # a version landed: the relay knows its layout
        if not self._writers:  # the relay's copy, as one rank holding every tensor whole (whatever its rank upstream)
            whole = replicated(layout.tensors)
            self._writers = [WeightsWriter(whole, None, 0, addresses, options=self._local, plugins=self._plugins)
                             for addresses in self._engines]
        dtypes = {t.name: getattr(torch, t.dtype) for t in layout.tensors}
        tensors = {name: as_tensor(raw).view(dtypes[name]) for name, raw in buffers.items()}
        for writer in self._writers:
            writer.multi_put(tensors)
        canary = self._reader.landed_canary  # the trainer's, for each engine to check (it came with this version)
        with ThreadPoolExecutor(len(self._writers), thread_name_prefix="rlsync-relay") as pool:
            written = list(pool.map(lambda w: w._write_parts(version, None, canary, notify=False), self._writers))
        failed = {f"engine {e} reader rank {r}": why for e, (_, bad) in enumerate(written) for r, why in bad.items()}
        for engine, (writer, (sent, _)) in enumerate(zip(self._writers, written)):  # alive, and would take it?
            for rank in sent:  # (a shared-memory write to a dead reader succeeds: only an answer shows it is there)
                try:
                    why = writer._ask_to_begin(rank, version)
                except RlsyncError as exc:  # it refuses the version: so does the host
                    why = str(exc)
                if why is not None:
                    failed[f"engine {engine} reader rank {rank}"] = why
        if failed:  # no local reader hears of this version (its kept Dones go with the writers' next version)
            detail = "; ".join(f"{who}: {why}" for who, why in sorted(failed.items()))
            raise PeerLostError(f"the node relay could not forward version {version} to every engine rank of its host "
                                f"({detail}); every rank stays on version {self.version}")
        for writer in self._writers:
            writer._notify()
        errors = []
        for writer, (sent, _) in zip(self._writers, written):  # every engine's answers read, so none is left for later
            try:
                writer._confirm(version, None, None, sent, {}, started)
            except RlsyncError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        deviations = [w.last_canary_deviation for w in self._writers if w.last_canary_deviation is not None]
        self._reader.canary_deviation = max(deviations) if deviations else None  # what the trainer's writers hear
        self.last_forward_seconds = time.perf_counter() - started

    def close(self) -> None:
        self._reader.close()
        for writer in self._writers:
            writer.close()

    def __enter__(self) -> NodeRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_room(layout: Layout) -> None:
    """The relay lands its host's tensors twice (the version landing, the one it forwarded) in host memory: refused
    before a byte is allocated where that does not fit, rather than killed by the kernel mid-version."""
    nbytes = 2 * region_offsets(layout, 0)[1]
    room = free_memory(None)
    if nbytes > room:
        raise ConfigError(f"NodeRelay: landing its host's tensors takes {nbytes / 2**30:.1f} GiB of host memory (two "
                          f"copies: the version landing and the one it forwarded), and {room / 2**30:.1f} GiB are free "
                          f"here: run no relay on this host (each engine then takes its own copy)")


def _layout_of(address: str, local: SyncOptions) -> Layout | None:
    """The layout of the engine whose first reader is at ``address``; None for one that learns it from its writer."""
    try:
        return reader_layout(address, secret=local.secret, timeout=local.timeout)
    except WeightMismatchError as exc:
        if "learns its layout from the writers" in str(exc):
            return None
        raise


def _union(layouts: Sequence[Layout]) -> list[TensorMeta]:
    """Every tensor the engines hold, once; an engine that disagrees with another on a tensor's dtype or shape is
    not an engine of the same model."""
    seen: dict[str, TensorMeta] = {}
    for engine, layout in enumerate(layouts):
        held = {s.tensor for s in layout.shards}
        for meta in layout.tensors:
            if meta.name not in held:
                continue
            other = seen.setdefault(meta.name, meta)
            if other != meta:
                raise ConfigError(f"NodeRelay: engine {engine} holds {meta.name!r} as {meta.dtype}{list(meta.shape)}, an "
                                  f"earlier engine as {other.dtype}{list(other.shape)}: relay engines of one model only")
    return list(seen.values())

