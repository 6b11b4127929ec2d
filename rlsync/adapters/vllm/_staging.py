"""Staged landing for vLLM: a ``WeightsReader`` whose complete versions wait for the engine.

The reader's service thread calls ``_stage`` once every byte of a version has landed; it blocks
there until the engine thread has taken the version (``next``) and loaded it (``finish``), so the
trainer's ``complete(v)`` returns only when the engine serves ``v``, and a loader error reaches
the trainer instead of a silent half-update.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from rlsync.core._builders import from_state_dict
from rlsync.core._errors import TransferTimeoutError
from rlsync.core._layout import TensorMeta
from rlsync.core._weights import WeightsReader

Finish = Callable[[BaseException | None], None]


class StagedReceiver:
    """Receives the HF-named ``tensors`` (``[(name, dtype, shape), ...]``) into a staging area."""

    def __init__(self, tensors: Sequence[Sequence[Any]], *, transport: str = "shm", host: str = "127.0.0.1",
                 port: int = 0, apply_timeout: float = 600.0) -> None:
        self.metas = [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s)) for n, d, s in tensors]
        layout = from_state_dict(self.metas)
        self._pending: queue.Queue[tuple[int, dict[str, np.ndarray], threading.Event, list[BaseException]]] = queue.Queue(1)
        self._apply_timeout = apply_timeout
        self.reader = WeightsReader(layout, layout, 0, transport=transport, landing="staged", host=host, port=port,
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
