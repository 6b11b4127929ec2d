"""``nixl``: NIXL with its UCX backend (RDMA, NVLink, CUDA IPC, cma/shm, tcp, as UCX finds them).

The reader registers its regions with a NIXL agent and describes them (agent metadata plus
addresses) over the control plane; the writer registers its source buffers once, adds the
reader's agent, and posts the WRITEs of a version at ``flush``, as one transfer. Initialized transfer handles
are kept and re-posted for every later version with the same writes, so descriptor lists are built once per
plan, not per step.

Device memory: ``transport_options={"device": "cuda:N"}`` puts the reader's regions on that GPU
(registered as VRAM: a GPU-to-GPU write, no host bounce); a writer's device tensors are registered
as VRAM as they are (the memory type comes from the tensor) when they go to device memory, and copied into
pinned host buffers first when they go to a reader's host memory. Registrations are cached by address:
a trainer whose tensors come back at the same addresses every step (parameters, the caching
allocator's reuse) registers once; one whose addresses change has the registrations that the last
version did not use dropped after each flush, so they never pile up.

Progress thread: off by default (``RLSYNC_NIXL_PROGRESS_THREAD=1`` to enable): on small machines it competes
with the copy for cores (about 1.8 GB/s with it, 4.5 without, on 2 cores), and on an H100 it did not make UCX's
own path from device memory into another process's host memory finish (that path now goes through pinned host
copies, see ``NixlLink._through_host``).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch

from rlsync import CurrentStreams, Landing, Link, PeerLostError, Run, Transport, TransportError

_counter = itertools.count()
_MAX_HANDLES = 64  # prepared transfers a link keeps for reuse (one per set of writes: a model's full versions share one)
_agents: dict[str, Any] = {}
Write = tuple[tuple[int, int, str], int, tuple[Run, ...]]  # (registration key, device id, runs) of one write


class _PreparedWrites(tuple):  # type: ignore[type-arg]
    """A prepared version's writes of one local memory type: found by identity (hashing 20,000 writes a version
    would cost what preparing saves), so that its transfer handle is found at once, version after version."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


class _Prepared:
    """A version's writes made once (``Link.prepare``): per local memory type, its registrations, the CUDA devices
    of its sources, and the sources themselves (registered memory stays alive while the version may be replayed)."""

    def __init__(self, writes: list[Write], sources: list[Any], devices: set[int]) -> None:
        self.by_type = {mem_type: _PreparedWrites(w for w in writes if w[0][2] == mem_type)
                        for mem_type in sorted({key[2] for key, _, _ in writes})}
        self.keys = frozenset(key for key, _, _ in writes)
        self.devices = tuple(sorted(devices))
        self.sources = sources


def _agent(role: str) -> Any:
    """One NIXL agent per process and role: creating one costs about half a second."""
    if role not in _agents:
        import logging

        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        logging.getLogger("nixl").setLevel(logging.WARNING)  # it logs every agent and backend at INFO

        threaded = os.environ.get("RLSYNC_NIXL_PROGRESS_THREAD", "0") == "1"
        # one agent serves every reader (or writer) thread of the process: several readers' service threads
        # drive progress and register memory at once, a writer posts to several readers from a pool, so NIXL
        # must serialize them (without it: segfaults in get_new_notifs)
        config = nixl_agent_config(enable_prog_thread=threaded, backends=["UCX"], sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        _agents[role] = nixl_agent(f"rlsync-{role}-{os.getpid()}-{next(_counter)}", config)
    return _agents[role]


class NixlLanding(Landing):
    name: ClassVar[str] = "nixl"

    @classmethod
    def available(cls) -> bool:
        try:
            import nixl._api  # noqa: F401
        except Exception:  # a broken CUDA build raises more than ImportError
            return False
        return True

    def __init__(self, nbytes: int, slots: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(nbytes, slots, options)
        self._agent = _agent("reader")
        device = self.options.get("device")
        self._regions: list[Any]
        if device is not None and torch.device(device).type == "cuda":
            self.memory = "device"
            self._regions = [torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device) for _ in range(slots)]
            torch.cuda.synchronize(device)
        else:
            self._regions = [np.zeros(max(nbytes, 1), dtype=np.uint8) for _ in range(slots)]
        self._register()

    @classmethod
    def over(cls, regions: Sequence[Any], options: Mapping[str, Any] | None = None) -> NixlLanding:
        """In place: the engine's own tensors (one per buffer) registered as they are (VRAM or DRAM)."""
        landing = cls.__new__(cls)
        Landing.__init__(landing, 0, 0, options)
        landing._agent = _agent("reader")
        tensors = [torch.as_tensor(r) for r in regions]
        landing.memory = "device" if tensors[0].is_cuda else "host"
        landing._regions = [t if t.is_cuda else t.numpy() for t in tensors]
        landing._register()
        return landing

    def _register(self) -> None:
        self._descs = [_desc(r) for r in self._regions]
        self._mem_type = _mem_type(self._regions[0])
        self._registered = self._agent.register_memory([(*d, "") for d in self._descs], mem_type=self._mem_type)

    @property
    def regions(self) -> Sequence[Any]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return {
            "agent": self._agent.name,
            "metadata": self._agent.get_agent_metadata(),
            "regions": [[addr, n] for addr, n, _ in self._descs],
            "mem_type": self._mem_type,
            "devid": self._descs[0][2],
        }

    def progress(self) -> None:
        self._agent.get_new_notifs()  # drives UCX progress for transports that need the target

    def close(self) -> None:
        self._agent.deregister_memory(self._registered)


def nixl_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is one NIXL raised: its bindings raise (``nixlRemoteDisconnectError``, ``nixlBackendError``,
    defined in ``nixl_cu13._bindings`` and the like) where its ``_api`` would otherwise answer "ERR"."""
    return type(exc).__module__.split(".")[0].startswith("nixl")


def _desc(memory: Any) -> tuple[int, int, int]:
    """``(address, nbytes, device id)`` of a numpy array or a tensor."""
    if isinstance(memory, np.ndarray):
        return memory.ctypes.data, memory.nbytes, 0
    return memory.data_ptr(), memory.numel() * memory.element_size(), max(memory.get_device(), 0)


def _mem_type(memory: Any) -> str:
    return "VRAM" if isinstance(memory, torch.Tensor) and memory.is_cuda else "DRAM"


class NixlLink(Link):
    def __init__(self, description: dict[str, Any]) -> None:
        self._agent = _agent("writer")
        self._peer = self._agent.add_remote_agent(description["metadata"])
        self._remote = [int(addr) for addr, _ in description["regions"]]
        self._remote_type = str(description.get("mem_type", "DRAM"))
        self._remote_devid = int(description.get("devid", 0))
        self._registered: dict[tuple[int, int, str], Any] = {}
        self._used: set[tuple[int, int, str]] = set()  # registrations the writes since the last flush used
        self._handles: dict[tuple[Write, ...], Any] = {}  # prepared transfers, by the writes they post
        self._writes: list[Write] = []  # gathered since the last flush
        self._prepared: list[_Prepared] = []  # prepared versions handed over since the last flush
        self._last_prepared: list[_Prepared] = []  # what the last flush posted of them: the same again uses the same memory
        self._after = CurrentStreams()  # the streams that produced device sources: synchronized before posting
        self._posted: list[Any] = []
        self._held: list[Any] = []  # device sources of posted writes: alive until flush
        self._host: dict[tuple[int, int], torch.Tensor] = {}  # pinned copies of device sources bound for host memory
        self._host_used: set[tuple[int, int]] = set()

    def _register(self, source: Any) -> tuple[int, int, str]:
        base, nbytes, devid = _desc(source)
        key = (base, nbytes, _mem_type(source))
        if key not in self._registered:
            self._registered[key] = self._agent.register_memory([(base, nbytes, devid, "")], mem_type=key[2])
        self._used.add(key)
        return key

    def write(self, source: Any, runs: Sequence[Run]) -> None:
        """Gathered, posted at ``flush`` as one transfer: one NIXL request and one wait per version, not one per
        tensor (a per-tensor post and device synchronize cost ~90 ms for 1622 tensors on an H100)."""
        if not runs:
            return
        if isinstance(source, torch.Tensor) and source.is_cuda:
            self._after.note(source)  # the work that produced it, before the NIC reads
            self._held.append(source)
            if self._remote_type == "DRAM":
                source = self._through_host(source)
        key = self._register(source)
        devid = _desc(source)[2]
        self._writes.append((key, devid, tuple(runs)))

    def prepare(self, parts: Sequence[tuple[Any, Sequence[Run]]]) -> Any:
        """The version's writes, registered and grouped once; replayed as they are (one lookup a version). Device
        sources bound for a reader's host memory go through pinned copies each version: written one by one."""
        if self._remote_type == "DRAM" and any(isinstance(s, torch.Tensor) and s.is_cuda for s, _ in parts):
            return super().prepare(parts)
        writes, devices = [], set()
        for source, runs in parts:
            if not runs:
                continue
            if isinstance(source, torch.Tensor) and source.is_cuda:
                devices.add(source.get_device())
            writes.append((self._register(source), _desc(source)[2], tuple(runs)))
        return _Prepared(writes, [source for source, _ in parts], devices)

    def write_prepared(self, prepared: Any) -> None:
        if not isinstance(prepared, _Prepared):
            super().write_prepared(prepared)
            return
        for device in prepared.devices:  # the work that produced the sources, before the NIC reads
            self._after.note_device(device)
        self._prepared.append(prepared)

    def _through_host(self, source: torch.Tensor) -> torch.Tensor:
        """A device source bound for a reader's host memory, copied into a pinned host buffer first (one per source
        address, reused every version), on the stream that produced it: UCX's own path from device memory into
        another process's host memory never finished on an H100 (4 GiB in 1622 tensors: "Endpoint timeout" with
        the reader polling, no end in 40 s with its progress thread), while host to host is a plain copy."""
        key = (source.data_ptr(), source.numel())
        host = self._host.get(key)
        if host is None:
            host = self._host[key] = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
        with torch.cuda.device(source.device):
            host.copy_(source.reshape(-1).view(torch.uint8), non_blocking=True)
        self._host_used.add(key)
        return host

    def _post(self) -> None:
        """The writes gathered since the last flush, as one prepared transfer per local memory type (a transfer has
        one; VRAM and DRAM sources go as two), each built once per set of writes."""
        if not self._writes and not self._prepared:
            return
        for stream in self._after.streams():  # once per stream, not per tensor: the sources are complete before the NIC reads
            stream.synchronize()
        self._after.clear()
        for prepared in self._prepared:
            for mem_type, prepared_writes in prepared.by_type.items():
                self._post_writes(prepared_writes, mem_type)
        writes, self._writes = self._writes, []
        for mem_type in sorted({key[2] for key, _, _ in writes}):
            self._post_writes(tuple(w for w in writes if w[0][2] == mem_type), mem_type)

    def _post_writes(self, writes: tuple[Write, ...], mem_type: str) -> None:
        handle = self._handles.get(writes)
        if handle is None:
            local = np.array([(base + s, n, devid) for (base, _, _), devid, runs in writes for s, _, _, n in runs],
                             dtype=np.uint64).reshape(-1, 3)
            remote = np.array([(self._remote[slot] + d, n, self._remote_devid) for _, _, runs in writes for _, slot, d, n in runs],
                              dtype=np.uint64).reshape(-1, 3)
            with self._peer_lost("NIXL could not prepare a write"):
                handle = self._agent.initialize_xfer(
                    "WRITE",
                    self._agent.get_xfer_descs(local, mem_type=mem_type),
                    self._agent.get_xfer_descs(remote, mem_type=self._remote_type),
                    self._peer,
                )
            self._handles[writes] = handle
        with self._peer_lost("NIXL could not post a write"):
            state = self._agent.transfer(handle)
        if state == "ERR":
            raise PeerLostError(f"NIXL could not post a write to {self._peer}: the reader is unreachable")
        self._posted.append(handle)

    @contextmanager
    def _peer_lost(self, what: str) -> Iterator[None]:
        """NIXL 1.5's bindings raise where its ``_api`` would answer "ERR": the same lost peer, said as one."""
        try:
            yield
        except Exception as exc:
            if nixl_failure(exc):
                raise PeerLostError(f"{what} to {self._peer} (the reader restarted or died): {exc}") from exc
            raise

    def flush(self) -> None:
        self._post()
        deadline = time.monotonic() + float(os.environ.get("RLSYNC_NIXL_TIMEOUT", "120"))
        for handle in self._posted:
            while True:
                with self._peer_lost("a NIXL write failed"):
                    state = self._agent.check_xfer_state(handle)
                if state == "DONE":
                    break
                if state == "ERR":
                    raise PeerLostError(f"a NIXL write to {self._peer} failed: the reader died or its memory went away")
                if time.monotonic() > deadline:
                    raise TransportError(f"a NIXL write to {self._peer} did not finish in time")
        self._posted.clear()
        self._held.clear()
        posted, self._prepared = self._prepared, []
        if not self._used and len(posted) == len(self._last_prepared) and all(
                p is q for p, q in zip(posted, self._last_prepared)):
            return  # the same prepared version again, nothing else: the same registrations, none stale
        self._last_prepared = posted
        used = self._used.union(*(p.keys for p in posted))
        stale = set(self._registered) - used  # sources the last version did not write from: gone or moved
        if stale:
            for writes in [k for k in self._handles if any(w[0] in stale for w in k)]:
                self._release(self._handles.pop(writes))
            for key in stale:
                self._agent.deregister_memory(self._registered.pop(key))
        self._used = set()
        self._host = {k: v for k, v in self._host.items() if k in self._host_used}  # deregistered above if unused
        self._host_used = set()
        if len(self._handles) > _MAX_HANDLES:  # writes of changing shape (deltas) would add one per version
            self._release_handles()

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - best effort: the handle is dropped either way
            pass

    def _release_handles(self) -> None:
        for handle in self._handles.values():
            self._release(handle)
        self._handles.clear()

    def close(self) -> None:
        self._release_handles()
        for reg in self._registered.values():
            self._agent.deregister_memory(reg)
        self._registered.clear()
        self._agent.remove_remote_agent(self._peer)


class NixlTransport(Transport):
    name: ClassVar[str] = "nixl"
    landing: ClassVar[type[Landing]] = NixlLanding
    device_sources: ClassVar[bool] = True

    @classmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        if not NixlLanding.available():
            raise TransportError("transport 'nixl' needs the nixl package: pip install 'rlsync[nixl]'")
        return NixlLink(description)
