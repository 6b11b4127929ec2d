"""A link's writes as batched tensor copies: what a transport that copies into regions of device memory (``cuda_ipc``;
the memory transport's device landings) does per version.

A link gathers its writes (each a source and its runs) as pairs of views, target and source, and issues them at
``flush`` as one ``torch._foreach_copy_`` per batch: one launch for a version instead of one per tensor. ``prepare``
makes a version's views once, so that the writer replays a version it prepared (``Link.prepare`` and
``write_prepared``) as one batch handed over, with no slicing, lookup or unpacking per tensor in Python: what a
version costs on the host stays the same from 1,600 tensors to 70,000.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rlsync.core.sync._transport import Run


@dataclass(frozen=True)
class PreparedCopies:
    """A version's copies, made once: target and source views in matching order, and the CUDA devices the sources
    live on (the copies wait for the work queued on those devices' current streams)."""

    targets: list[torch.Tensor]
    sources: list[torch.Tensor]
    devices: tuple[int, ...] = field(default=())


class BatchedCopies:
    """Copies into views of ``regions`` (one tensor per slot), gathered until ``take``. ``cuda`` is the regions'
    CUDA device index (None: host tensors), the device a host source's copy is noted on."""

    _MAX_VIEWS = 1 << 16  # region views kept for loose writes (a model's runs fit; changing delta runs do not pile up)

    def __init__(self, regions: Sequence[torch.Tensor], cuda: int | None = None) -> None:
        self._regions = list(regions)
        self._cuda = cuda
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}  # (slot, offset, n) -> that part of the region
        self._loose = PreparedCopies([], [])  # written one source at a time since the last take
        self._loose_devices: set[int] = set()
        self._batches: list[PreparedCopies] = []

    def _target(self, slot: int, offset: int, n: int) -> torch.Tensor:
        key = (slot, offset, n)
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self._MAX_VIEWS:
                self._views.clear()
            view = self._views[key] = self._regions[slot][offset : offset + n]
        return view

    def _device_of(self, source: torch.Tensor) -> int | None:
        return source.get_device() if source.is_cuda else self._cuda

    def add(self, source: Any, runs: Sequence[Run]) -> None:
        """One source's runs, as ``Link.write`` takes them (a numpy array or a tensor of bytes)."""
        source = torch.from_numpy(source) if isinstance(source, np.ndarray) else source
        device = self._device_of(source)
        if device is not None:
            self._loose_devices.add(device)
        whole = source.numel()
        for src, slot, dst, n in runs:
            self._loose.targets.append(self._target(slot, dst, n))
            self._loose.sources.append(source if src == 0 and n == whole else source[src : src + n])

    def prepare(self, parts: Sequence[tuple[Any, Sequence[Run]]]) -> PreparedCopies:
        """``parts`` (as ``Link.prepare`` takes them) as one batch of views, made once."""
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        devices: set[int] = set()
        regions = self._regions
        for source, runs in parts:
            source = torch.from_numpy(source) if isinstance(source, np.ndarray) else source
            device = self._device_of(source)
            if device is not None:
                devices.add(device)
            whole = source.numel()
            for src, slot, dst, n in runs:
                targets.append(regions[slot][dst : dst + n])
                sources.append(source if src == 0 and n == whole else source[src : src + n])
        return PreparedCopies(targets, sources, tuple(sorted(devices)))

    def add_prepared(self, prepared: PreparedCopies) -> None:
        self._batches.append(prepared)

    def devices(self) -> set[int]:
        """The CUDA devices of the sources gathered since the last take."""
        return self._loose_devices.union(*(b.devices for b in self._batches))

    def take(self) -> list[PreparedCopies]:
        """The batches gathered since the last take (loose writes as one), to issue; gathering starts anew."""
        batches = self._batches + ([self._loose] if self._loose.targets else [])
        self._batches, self._loose, self._loose_devices = [], PreparedCopies([], []), set()
        return batches

    @staticmethod
    def copy(batches: Sequence[PreparedCopies]) -> None:
        """Issue ``batches`` on the current stream: one ``torch._foreach_copy_`` each."""
        with torch.no_grad():
            for batch in batches:
                torch._foreach_copy_(batch.targets, batch.sources, non_blocking=True)

    def clear_views(self) -> None:
        self._views.clear()
