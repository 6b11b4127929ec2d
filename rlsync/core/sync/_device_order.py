"""Ordering device work across threads and processes: the few CUDA calls the data path needs, no-ops elsewhere.

A trainer may produce its tensors on a side stream, and the writer copies them from other threads (a pool, one
per reader), whose current stream is not that one: so ``put`` notes the stream current where each tensor was put,
``complete`` records one event on each such stream, and every thread that reads the tensors waits on those events
first (one wait per stream, not per tensor: events on one stream complete in order). An engine that pauses for a
version landing in its own tensors, or that commits one, must also have finished what it queued on the device
before another process writes there or before it serves.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

Ready = list[tuple[torch.device, Any]]  # (device, CUDA event) pairs to wait for


# torch's own cheap lookup of a device's current stream (what torch.compile's generated code calls); absent from
# CPU builds, where nothing gets here
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CurrentStreams:
    """The streams current in this thread on the CUDA devices noted, since the last ``clear``: what a copy of
    tensors put or written there must wait for. ``note`` runs once per tensor per version, where
    ``torch.cuda.current_stream`` (which builds a ``Stream``, and hashing one a ``torch.device``) cost 15 µs a
    tensor on an H100's host, 24 ms a version for 1622 tensors; the raw stream pointer is one call, and a ``Stream``
    is built once per stream. For a transport's device ``Link`` too (``cuda_ipc`` and ``nixl`` use it)."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], Any] = {}  # (device index, raw stream) -> its torch.cuda.Stream

    def note(self, tensor: Any) -> None:
        """Note the stream current on ``tensor``'s device now (nothing for a tensor off CUDA)."""
        if not (isinstance(tensor, torch.Tensor) and tensor.is_cuda):
            return
        self.note_device(tensor.get_device())

    def note_device(self, index: int) -> None:
        """Note the stream current on CUDA device ``index`` now."""
        if _raw_stream is None:
            stream = torch.cuda.current_stream(index)
            self._seen.setdefault((index, stream.cuda_stream), stream)
            return
        key = (index, _raw_stream(index))
        if key not in self._seen:
            self._seen[key] = torch.cuda.current_stream(index)

    def streams(self) -> list[Any]:
        return list(self._seen.values())

    def clear(self) -> None:
        self._seen = {}


def ready_events(streams: Iterable[Any]) -> Ready:
    """One event recorded now on each stream: once they complete, everything queued there so far has run."""
    ready: Ready = []
    for stream in streams:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call, unused-ignore]
        event.record(stream)
        ready.append((stream.device, event))
    return ready


def wait_ready(ready: Ready) -> None:
    """Make this thread's current stream on each device wait for its events (later work there runs after)."""
    for device, event in ready:
        torch.cuda.current_stream(device).wait_event(event)


def synchronize_devices(tensors: Iterable[Any]) -> None:
    """Wait for all work queued on every CUDA device that holds one of ``tensors``."""
    devices = {t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
    for device in devices:
        torch.cuda.synchronize(device)
