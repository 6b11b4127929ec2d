"""Plain torch / transformers models as weight receivers: weights land in place in an
``nn.Module``'s parameters.

The parameters are re-pointed at the reader's landing memory (two slots, direct landing): a
version is written into the slot the model is not using and, once all its bytes are there, the
parameters switch to it between two forward passes (``with receiver.serving(): model(...)``).
No copy, no ``load_state_dict``, and a writer dying midway leaves the model as it was.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlsync.core._builders import from_state_dict
from rlsync.core._layout import Layout
from rlsync.core._weights import WeightsReader


def module_layout(module: torch.nn.Module) -> Layout:
    """The layout of a module's parameters on one rank (tied parameters once, under their first name).

    Build the writer's layout with this too, so both sides agree on names, shapes and dtypes.
    """
    return from_state_dict(dict(module.named_parameters()))


class ModuleReceiver:
    """Receives weight versions into ``module``'s parameters; see the module docstring.

    ``src`` is the writer's layout; by default it is learned from the writer's hello, so the trainer
    may send its whole ``state_dict()`` (a tied ``lm_head.weight`` alias, extra buffers): only what this
    module holds is sent. Other keyword arguments go to ``WeightsReader`` (``transport``, ``host``,
    ``secret``, ``checksum``, ...).
    """

    def __init__(self, module: torch.nn.Module, src: Layout | None = None, **reader_options: Any) -> None:
        self.module = module
        self._params = dict(module.named_parameters())
        for name, p in self._params.items():
            if p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(f"parameter {name!r} must be a contiguous CPU tensor to receive in place (it is on {p.device})")
        dst = module_layout(module)
        self._serving = threading.RLock()
        self.reader = WeightsReader(src, dst, 0, landing="direct", on_version=self._switch, **reader_options)
        live = self.reader.buffers()
        with torch.no_grad():
            for name, p in self._params.items():  # version "current": the weights the module was built with
                np.copyto(live[name], p.detach().reshape(-1).view(torch.uint8).numpy())
        self._point_at(live)

    @property
    def address(self) -> str:
        return self.reader.address

    @property
    def version(self) -> int:
        return self.reader.version

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Hold while running the model: a new version switches in only between such blocks."""
        with self._serving:
            yield

    def wait_for_version(self, version: int | None = None, timeout: float | None = None) -> int:
        return self.reader.wait_for_version(version, timeout)

    def _point_at(self, buffers: dict[str, np.ndarray]) -> None:
        for name, p in self._params.items():
            p.data = torch.from_numpy(buffers[name]).view(p.dtype).view(p.shape)

    def _switch(self, version: int, buffers: dict[str, np.ndarray]) -> None:
        with self._serving:
            self._point_at(buffers)

    def close(self) -> None:
        """Stop receiving; the parameters keep the live version (copied out of the landing memory)."""
        with self._serving:
            for p in self._params.values():
                p.data = p.data.clone()
        self.reader.close()

    def __enter__(self) -> ModuleReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
