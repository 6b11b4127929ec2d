"""Staged landing for vLLM: a ``WeightsReader`` whose complete versions wait for the engine.

The reader's service thread calls ``_stage`` once every byte of a version has landed; it blocks
there until the engine thread has taken the version (``next``) and loaded it (``finish``), so the
trainer's ``complete(v)`` returns only when the engine serves ``v``, and a loader error reaches
the trainer instead of a silent half-update.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from rlsync.core._builders import boxes_in_full_tensors, from_state_dict
from rlsync.core._errors import ConfigError, TransferTimeoutError
from rlsync.core._layout import Box, Layout, TensorMeta
from rlsync.core._weights import WeightsReader

Finish = Callable[[BaseException | None], None]
#: Per engine rank, ``{checkpoint tensor name: [offsets, sizes]}`` of the part that rank loads
#: (what ``rlsync_probe`` returns, one entry per worker in rank order).
RankBoxes = Sequence[Mapping[str, Sequence[Sequence[int]]]]


def tensor_metas(tensors: Sequence[Sequence[Any]]) -> list[TensorMeta]:
    """``[(name, dtype, shape), ...]`` (dtype as ``torch.bfloat16`` or ``bfloat16``) as TensorMetas."""
    return [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s)) for n, d, s in tensors]


def engine_layout(tensors: Sequence[Sequence[Any]], boxes: RankBoxes | None = None) -> Layout:
    """The layout an engine receives into: with ``boxes`` (from ``rlsync_probe``), each rank gets only the
    part of each checkpoint tensor its loader reads; without, one rank gets every tensor whole.
    The trainer builds its ``WeightsWriter`` with this as the destination layout."""
    metas = tensor_metas(tensors)
    if boxes is None:
        return from_state_dict(metas)
    held = {name for rank in boxes for name in rank}
    unread = [m.name for m in metas if m.name not in held]
    if unread:
        raise ConfigError(f"vLLM's loader reads no part of {len(unread)} tensor(s) on any worker, e.g. {unread[:3]}: "
                          f"leave them out of the tensor list (a tied lm_head.weight is one such) or check their names")
    return boxes_in_full_tensors(metas, [{n: Box(tuple(o), tuple(s)) for n, (o, s) in rank.items()} for rank in boxes])


class StagedReceiver:
    """Receives the HF-named ``tensors`` (``[(name, dtype, shape), ...]``) into a staging area."""

    def __init__(self, tensors: Sequence[Sequence[Any]], *, boxes: RankBoxes | None = None, rank: int = 0,
                 transport: str = "shm", host: str = "127.0.0.1", port: int = 0, apply_timeout: float = 600.0) -> None:
        layout = engine_layout(tensors, boxes)
        mine = {s.tensor for s in layout.shards if s.rank == rank}
        self.metas = [m for m in layout.tensors if m.name in mine]  # what this rank's loader reads
        self._pending: queue.Queue[tuple[int, dict[str, np.ndarray], threading.Event, list[BaseException]]] = queue.Queue(1)
        self._apply_timeout = apply_timeout
        trainer = from_state_dict(layout.tensors)  # one trainer process holding whole checkpoint tensors
        self.reader = WeightsReader(trainer, layout, rank, transport=transport, landing="staged", host=host, port=port,
                                    on_version=self._stage)

    @property
    def address(self) -> str:
        return self.reader.address

    def _stage(self, version: int, buffers: dict[str, np.ndarray]) -> None:
        done, errors = threading.Event(), []  # type: ignore[var-annotated]
        self._pending.put((version, buffers, done, errors))
        if not done.wait(self._apply_timeout):
            raise TransferTimeoutError(f"vLLM did not load version {version} within {self._apply_timeout} s")
        if errors:
            raise errors[0]

    def next(self, timeout: float) -> tuple[int, Iterator[tuple[str, Any]], Finish]:
        """Engine thread: the next landed version, its tensors as views, and ``finish(error or None)``."""
        import torch

        try:
            version, buffers, done, errors = self._pending.get(timeout=timeout)
        except queue.Empty:
            raise TransferTimeoutError(f"no weight version arrived within {timeout} s") from None

        def finish(error: BaseException | None) -> None:
            if error is not None:
                errors.append(error)
            done.set()

        views = ((m.name, torch.from_numpy(buffers[m.name]).view(getattr(torch, m.dtype)).view(m.shape)) for m in self.metas)
        return version, views, finish

    def close(self) -> None:
        self.reader.close()
