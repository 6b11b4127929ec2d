"""Reused host buffers for tensors a host transport cannot read where they are: device memory (a trainer's
CUDA parameters) and strided views.

Each buffer name gets one host tensor, allocated on first use and reused every version (pinned when a CUDA
device exists, so device-to-host copies are DMA and can run asynchronously). ``stage`` issues the copy and
returns the buffer; ``wait(name)`` returns once that buffer's copy has finished (the writer calls it
just before it sends that buffer, so later tensors still cross PCIe while earlier ones are sent),
``wait()`` once every copy has. The copy is one ``Tensor.copy_``: the same line runs on CPU tensors (a strided view)
and on device tensors, so CPU tests exercise it; only the event that tracks an asynchronous device copy is
CUDA-specific.
"""

from __future__ import annotations

from typing import Any

import torch


def _pinned() -> bool:
    """Pin host buffers only where a CUDA device can use them (pinning needs the CUDA runtime)."""
    return torch.cuda.is_available()


class HostStaging:
    """One reused host buffer per name; see the module docstring. Used by one thread (the writer's caller)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # (CUDA event recorded after an asynchronous copy, its source): the source is held until the copy is done,
        # so the caching allocator cannot hand its memory to another tensor while the copy still reads it
        self._pending: dict[str, tuple[Any, Any]] = {}

    def needs_staging(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` cannot be read in place by a host transport."""
        return tensor.device.type != "cpu" or not tensor.is_contiguous()

    def stage(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into ``name``'s host buffer (asynchronously from a CUDA device) and return that buffer:
        read it only after ``wait``."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=_pinned())
        on_cuda = tensor.device.type == "cuda"
        with torch.no_grad():
            buffer.copy_(tensor.detach(), non_blocking=on_cuda and buffer.is_pinned())
        if on_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
            event.record(torch.cuda.current_stream(tensor.device))
            self._pending[name] = (event, tensor)
        return buffer

    def stage_all(self, tensors: dict[str, torch.Tensor]) -> None:
        """``stage`` of every one of ``tensors`` (of one device), as one batched copy and one event: a whole version
        saved at a cost that does not grow with its tensor count in Python (an in-place reader saves the engine's
        last version after each commit). Buffers are allocated the first time, one by one."""
        if not tensors:
            return
        if len(self._buffers) < len(tensors):  # the first version (or new names): allocate what is missing
            for name, tensor in tensors.items():
                if name not in self._buffers:
                    self._buffers[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=_pinned())
        buffers = [self._buffers[name] for name in tensors]
        sources = list(tensors.values())  # what a version saves is bytes (no autograd): copied as they are
        on_cuda = sources[0].device.type == "cuda"
        with torch.no_grad():  # a buffer of another shape is an error here, as it would be in stage
            torch._foreach_copy_(buffers, sources, non_blocking=on_cuda and buffers[0].is_pinned())
        if on_cuda:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
            event.record(torch.cuda.current_stream(sources[0].device))
            self._pending["\0all"] = (event, sources)  # the sources are held until the copy is done

    @property
    def staged(self) -> bool:
        """Whether any tensor was ever staged here (a writer with none reads every source in place)."""
        return bool(self._buffers)

    def wait(self, name: str | None = None) -> None:
        """Return once ``name``'s copy (default: every copy issued by ``stage``) has finished. Thread-safe: the
        writer's per-reader threads wait for the same buffers."""
        if name is not None:
            pending = self._pending.get(name)
            if pending is not None:
                pending[0].synchronize()
            return
        for event, _ in list(self._pending.values()):
            event.synchronize()
        self._pending.clear()

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The host buffers by name (read them after ``wait``)."""
        return dict(self._buffers)

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers (allocated once, kept for the next version)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
