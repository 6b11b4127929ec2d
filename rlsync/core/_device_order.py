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


def producing_stream(tensor: Any) -> Any:
    """The stream current on ``tensor``'s device in this thread (what produced it), or None off CUDA."""
    if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
        return torch.cuda.current_stream(tensor.device)
    return None


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
