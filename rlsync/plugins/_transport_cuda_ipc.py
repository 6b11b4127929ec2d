"""``cuda_ipc``: GPU to GPU on one host through CUDA IPC, one device copy per byte, nothing through the host.

The reader allocates its regions on its GPU and shares them once: ``describe()`` is the GPU's UUID and
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

_mapped: dict[bytes, torch.Tensor] = {}  # IPC handle -> the region mapped into this process
# IPC handle -> a region this process shares: CUDA cannot open a handle in the process that made it, so a writer in the
# reader's own process (tests, rlsync.testing.check_transport) writes the tensor itself
_own: dict[bytes, torch.Tensor] = {}
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
        self._regions = [torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device) for _ in range(slots)]
        torch.cuda.synchronize(device)
        shares = [r.untyped_storage()._share_cuda_() for r in self._regions]  # type: ignore[no-untyped-call]
        # (device, handle, size, offset in the allocation, ref-counter file, its offset, event handle, sync needed)
        self._description = {"uuid": _uuid(device.index or 0), "regions": [list(share[1:]) for share in shares]}
        with _lock:
            _own.update({bytes(share[1]): region for share, region in zip(shares, self._regions)})

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


def _open_region(index: int, share: Sequence[Any]) -> torch.Tensor:
    handle = bytes(share[0])
    with _lock:
        region = _own.get(handle)
        if region is None:
            region = _mapped.get(handle)
        if region is None:
            storage = torch.UntypedStorage._new_shared_cuda(index, *share)
            region = torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}").set_(storage, 0, (int(share[1]),), (1,))
            _mapped[handle] = region
    return region


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
