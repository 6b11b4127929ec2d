"""``cuda_ipc``: GPU to GPU on one host through CUDA IPC, one device copy per byte, nothing through the host.

The reader allocates its regions on its GPU (or, in place, takes the engine's own tensors) and shares them once: ``describe()`` is the GPU's UUID and
one IPC handle per region (``UntypedStorage._share_cuda_``, what ``torch.multiprocessing`` sends, here as
plain data over msgpack). The writer maps each region once per process (cached by handle) on the GPU with
that UUID (device indices differ between processes under ``CUDA_VISIBLE_DEVICES``; UUIDs do not), copies
its device tensors into it on a stream of its own (after the work that produced them), and ``flush``
waits for an event recorded after the last copy, so Done means the bytes are there.

The writer's sources may be on any GPU of the host (peer copies) or in host memory (then an upload).
CUDA-only: tested under the ``gpu`` marker and by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from rlsync import BatchedCopies, CurrentStreams, Landing, Link, Run, Transport, TransportError

# A storage's IPC share names the caching allocator's whole segment (the handle) plus where in it the storage starts
# (torch's CUDACachingAllocator::shareIpcHandle): every storage of one segment has the same handle, so a storage is
# (handle, offset in the segment), as torch's own cache keys it (torch/multiprocessing/reductions.py).
StorageKey = tuple[bytes, int]
_mapped: dict[StorageKey, torch.UntypedStorage] = {}  # the storages mapped into this process
# the storages this process shares: CUDA cannot open a handle in the process that made it, so a writer in the
# reader's own process (tests, rlsync.testing.check_transport) writes the tensor itself
_own: dict[StorageKey, torch.UntypedStorage] = {}


def storage_key(entry: Sequence[Any]) -> StorageKey:
    """The storage a described region lies in: ``entry`` is ``_share_cuda_()`` less its device (handle, storage
    size, offset of the storage in the segment, ...), as ``describe()`` lists it."""
    return bytes(entry[0]), int(entry[2])
_lock = threading.Lock()


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _local_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``."""
    for index in range(torch.cuda.device_count()):
        if _uuid(index) == uuid:
            return index
    raise TransportError(f"the reader's GPU {uuid} is not visible to this writer (CUDA_VISIBLE_DEVICES): cuda_ipc needs "
                         f"both processes on one host and that GPU visible to both; use transport='nixl' across hosts")


class CudaIpcLanding(Landing):
    """Regions on the reader's GPU (``transport_options={"device": "cuda:N"}``, default the current device)."""

    name: ClassVar[str] = "cuda_ipc"
    same_host_only: ClassVar[bool] = True
    memory: Literal["host", "device"] = "device"

    @classmethod
    def available(cls) -> bool:
        try:
            return torch.cuda.is_available()
        except Exception:  # a broken driver raises more than RuntimeError
            return False

    def __init__(self, nbytes: int, slots: int, options: Mapping[str, Any] | None = None) -> None:
        super().__init__(nbytes, slots, options)
        if not self.available():
            raise TransportError("transport 'cuda_ipc' needs a CUDA GPU in the reader's process; use 'shm' on the host")
        device = torch.device(self.options.get("device") or f"cuda:{torch.cuda.current_device()}")
        self._share([torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device) for _ in range(slots)])

    @classmethod
    def over(cls, regions: Sequence[Any], options: Mapping[str, Any] | None = None) -> CudaIpcLanding:
        """In place: the engine's own CUDA tensors (one per buffer), shared once each."""
        landing = cls.__new__(cls)
        Landing.__init__(landing, 0, 0, options)
        if any(not (isinstance(r, torch.Tensor) and r.is_cuda) for r in regions):
            raise TransportError("cuda_ipc lands in place only in CUDA tensors")
        landing._share(list(regions))
        return landing

    def _share(self, regions: list[torch.Tensor]) -> None:
        """Describe ``regions`` to writers: per region, its storage's IPC share and where in the storage it sits."""
        self._regions = regions
        torch.cuda.synchronize(regions[0].device)
        shares = [r.untyped_storage()._share_cuda_() for r in regions]  # type: ignore[no-untyped-call]
        # (device, handle, size, offset in the allocation, ref-counter file, its offset, event handle, sync needed),
        # then the region's byte offset in the storage and its size
        self._description = {"uuid": _uuid(regions[0].device.index or 0),
                             "regions": [[*share[1:], r.storage_offset() * r.element_size(), r.numel() * r.element_size()]
                                         for share, r in zip(shares, regions)]}
        with _lock:
            _own.update({storage_key(share[1:]): r.untyped_storage() for share, r in zip(shares, regions)})

    @property
    def regions(self) -> Sequence[torch.Tensor]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return self._description

    def close(self) -> None:
        with _lock:
            for entry in self._description["regions"]:
                _own.pop(storage_key(entry), None)
        self._regions = []


def _open_region(index: int, entry: Sequence[Any]) -> torch.Tensor:
    """A described region as a ``uint8`` tensor: its storage mapped once per process, viewed where the region is."""
    share, offset, nbytes = entry[:7], int(entry[7]), int(entry[8])
    key = storage_key(entry)
    with _lock:
        storage = _own.get(key)
        if storage is None:
            storage = _mapped.get(key)
        if storage is None:
            storage = _mapped[key] = torch.UntypedStorage._new_shared_cuda(index, *share)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, offset, (nbytes,), (1,))


class CudaIpcLink(Link):
    """Writes are gathered and issued at ``flush`` as one batched copy (``torch._foreach_copy_``: one launch for
    the whole version instead of one per tensor, which bounds small tensors by the host, not the GPU); a version the
    writer prepared is handed over as one batch of views made once (``rlsync.core.BatchedCopies``)."""

    def __init__(self, description: dict[str, Any]) -> None:
        self._index = _local_index(str(description["uuid"]))
        self._regions = [_open_region(self._index, share) for share in description["regions"]]
        self._stream = torch.cuda.Stream(self._index)  # type: ignore[no-untyped-call, unused-ignore]
        self._copies = BatchedCopies(self._regions, cuda=self._index)
        self._after = CurrentStreams()  # the streams the sources were written from: the copies wait for them

    def write(self, source: Any, runs: Sequence[Run]) -> None:
        self._copies.add(source, runs)

    def prepare(self, parts: Sequence[tuple[Any, Sequence[Run]]]) -> Any:
        return self._copies.prepare(parts)

    def write_prepared(self, prepared: Any) -> None:
        self._copies.add_prepared(prepared)

    def flush(self) -> None:
        # the copies wait for the work queued so far on this thread's current stream of each source's device
        for device in self._copies.devices():
            self._after.note_device(device)
        batches = self._copies.take()
        if batches:
            for stream in self._after.streams():
                self._stream.wait_stream(stream)
            with torch.cuda.stream(self._stream):
                BatchedCopies.copy(batches)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
        event.record(self._stream)
        event.synchronize()
        self._after.clear()  # the sources of the copies (held by the batches until here) may be reused from now on

    def close(self) -> None:
        self.flush()
        self._regions = []  # the mappings stay cached: a reconnecting writer reuses them
        self._copies.clear_views()


class CudaIpcTransport(Transport):
    name: ClassVar[str] = "cuda_ipc"
    landing: ClassVar[type[Landing]] = CudaIpcLanding
    device_sources: ClassVar[bool] = True

    @classmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        if not CudaIpcLanding.available():
            raise TransportError("transport 'cuda_ipc' needs a CUDA GPU in the writer's process too")
        return CudaIpcLink(description)
