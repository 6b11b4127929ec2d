"""Plain torch / transformers models as weight receivers: weights land in place in an
``nn.Module``'s parameters.

The parameters are re-pointed at the reader's landing memory (two slots, direct landing): a
version is written into the slot the model is not using and, once all its bytes are there, the
parameters switch to it between two forward passes (``with receiver.serving(): model(...)``).
No copy, no ``load_state_dict``, and a writer dying midway leaves the model as it was.

``wire="fp8"``: the module receives the fp8 block-quantized checkpoint format (``rlsync.wire``;
the writer uses ``wire="fp8"`` too) into a staging slot and loads it as transformers loads an
fp8 checkpoint where no fp8 kernel runs: each weight dequantized to its parameter's dtype. That
is lossy against the trainer's weights (equal to a fresh load of the same fp8 checkpoint), so it
is only done when asked for, and says so.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from rlsync import ConfigError, Layout, RlsyncWarning, SyncOptions, WeightsReader
from rlsync.layouts import from_state_dict


def module_layout(module: torch.nn.Module) -> Layout:
    """The layout of a module's parameters on one rank (tied parameters once, under their first name).

    Build the writer's layout with this too, so both sides agree on names, shapes and dtypes.
    """
    return from_state_dict(dict(module.named_parameters()))


class ModuleReceiver:
    """Receives weight versions into ``module``'s parameters; see the module docstring.

    ``src`` is the writer's layout; by default it is learned from the writer's hello, so the trainer
    may send its whole ``state_dict()`` (a tied ``lm_head.weight`` alias, extra buffers): only what this
    module holds is sent. ``options`` (``rlsync.SyncOptions``) go to the ``WeightsReader`` (transport, host,
    secret, verify); their ``wire`` says what the writer sends: the parameters' own dtypes (``"full"`` or
    ``"delta"``, landing in place) or ``"fp8"`` (lossy; see the module docstring).
    """

    def __init__(self, module: torch.nn.Module, src: Layout | None = None, *, options: SyncOptions | None = None) -> None:
        options = options or SyncOptions()
        if options.codec not in (None, "fp8"):
            raise ConfigError(f"ModuleReceiver: wire={options.wire!r} is not one it can load; use 'full', 'delta' or 'fp8'")
        self.module = module
        self.wire = "fp8" if options.codec == "fp8" else "full"
        wire = self.wire
        self._params = dict(module.named_parameters())
        for name, p in self._params.items():
            if p.device.type != "cpu" or not p.is_contiguous():
                raise ValueError(f"parameter {name!r} must be a contiguous CPU tensor to receive in place (it is on {p.device})")
        self._serving = threading.RLock()
        if wire == "fp8":
            from rlsync.wire import fp8_metas

            warnings.warn("ModuleReceiver(wire='fp8'): the module gets the fp8-dequantized weights (lossy against the "
                          "trainer's; what transformers loads from an fp8 checkpoint without fp8 kernels)", RlsyncWarning, stacklevel=2)
            dst = from_state_dict(fp8_metas(module_layout(module).tensors))
            self.reader = WeightsReader(src, dst, 0, options=options, landing="staged", on_version=self._dequantize)
            return
        dst = module_layout(module)
        self.reader = WeightsReader(src, dst, 0, options=options, landing="direct", on_version=self._switch)
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

    def _dequantize(self, version: int, buffers: dict[str, np.ndarray]) -> None:
        """Load an fp8-format version: the new weights are built beside the live ones, then swapped in."""
        from rlsync.wire import SCALE_SUFFIX, dequantize, is_quantized, scale_shape

        new: dict[str, torch.Tensor] = {}
        for name, p in self._params.items():
            raw = torch.from_numpy(buffers[name])
            if is_quantized(name, tuple(p.shape)):
                scale = torch.from_numpy(buffers[name + SCALE_SUFFIX]).view(torch.float32).view(scale_shape(tuple(p.shape)))
                new[name] = dequantize(raw.view(torch.float8_e4m3fn).view(p.shape), scale, p.dtype)
            else:
                new[name] = raw.view(p.dtype).view(p.shape).clone()
        with self._serving:
            for name, p in self._params.items():
                p.data = new[name]

    def close(self) -> None:
        """Stop receiving; the parameters keep the live version (copied out of the landing memory)."""
        with self._serving:
            if self.wire == "full":
                for p in self._params.values():
                    p.data = p.data.clone()
        self.reader.close()

    def __enter__(self) -> ModuleReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
