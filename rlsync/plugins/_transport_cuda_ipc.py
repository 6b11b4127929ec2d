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

from rlsync import Landing, Link, Run, Transport, TransportError

_mapped: dict[bytes, torch.UntypedStorage] = {}  # IPC handle -> the storage mapped into this process
# IPC handle -> a region this process shares: CUDA cannot open a handle in the process that made it, so a writer in the
# reader's own process (tests, rlsync.testing.check_transport) writes the tensor itself
_own: dict[bytes, torch.UntypedStorage] = {}
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
            _own.update({bytes(share[1]): r.untyped_storage() for share, r in zip(shares, regions)})

    @property
    def regions(self) -> Sequence[torch.Tensor]:
        return self._regions

    def describe(self) -> dict[str, Any]:
        return self._description

    def close(self) -> None:
        with _lock:
            for share in self._description["regions"]:
                _own.pop(bytes(share[0]), None)
        self._regions = []


def _open_region(index: int, entry: Sequence[Any]) -> torch.Tensor:
    """A described region as a ``uint8`` tensor: its storage mapped once per process, viewed where the region is."""
    share, offset, nbytes = entry[:7], int(entry[7]), int(entry[8])
    handle = bytes(share[0])
    with _lock:
        storage = _own.get(handle)
        if storage is None:
            storage = _mapped.get(handle)
        if storage is None:
            storage = _mapped[handle] = torch.UntypedStorage._new_shared_cuda(index, *share)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, offset, (nbytes,), (1,))


class CudaIpcLink(Link):
    def __init__(self, description: dict[str, Any]) -> None:
        self._index = _local_index(str(description["uuid"]))
        self._regions = [_open_region(self._index, share) for share in description["regions"]]
        self._stream = torch.cuda.Stream(self._index)  # type: ignore[no-untyped-call, unused-ignore]
        self._held: list[torch.Tensor] = []  # sources of copies in flight: alive until flush

    def write(self, source: Any, runs: Sequence[Run]) -> None:
        if isinstance(source, np.ndarray):
            source = torch.from_numpy(source)
        # the copies wait for the work that produced the source on its device's current stream
        self._stream.wait_stream(torch.cuda.current_stream(source.device if source.is_cuda else self._index))
        with torch.cuda.stream(self._stream):
            for src, slot, dst, n in runs:
                self._regions[slot][dst : dst + n].copy_(source[src : src + n], non_blocking=True)
        self._held.append(source)

    def flush(self) -> None:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
        event.record(self._stream)
        event.synchronize()
        self._held.clear()

    def close(self) -> None:
        self.flush()
        self._regions = []  # the mappings stay cached: a reconnecting writer reuses them


class CudaIpcTransport(Transport):
    name: ClassVar[str] = "cuda_ipc"
    landing: ClassVar[type[Landing]] = CudaIpcLanding
    device_sources: ClassVar[bool] = True

    @classmethod
    def open(cls, description: dict[str, Any], options: Mapping[str, Any] | None = None) -> Link:
        if not CudaIpcLanding.available():
            raise TransportError("transport 'cuda_ipc' needs a CUDA GPU in the writer's process too")
        return CudaIpcLink(description)
