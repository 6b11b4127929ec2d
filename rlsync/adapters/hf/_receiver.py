"""Plain torch / transformers models as weight receivers: weights land in place in an
``nn.Module``'s parameters.

A version lands in a host staging slot (``WeightsReader``, staged landing); once all its bytes are
there it is copied into the parameters in place, between two forward passes (``with
receiver.serving(): model(...)``), on whatever device they live. A parameter's memory never moves
(a CUDA graph that captured its address stays right), no second copy of the model is made on the
device, and a writer dying midway leaves the model as it was. Extra memory: one host copy of the
module's weights (the staging slot).

``landing="in_place"`` (with a transport that lands in memory it did not allocate: ``cuda_ipc``, ``nixl``):
the writer writes the parameters themselves, one copy per byte and no staging; the model waits (``serving``
blocks) from a version's first byte until it is complete and checked, and a version that fails or whose writer
dies is undone from a host copy of the last one (see ``rlsync.WeightsReader``).

``wire="fp8"``: the module receives the fp8 block-quantized checkpoint format (``rlsync.wire``;
the writer uses ``wire="fp8"`` too) into a staging slot and loads it as transformers loads an
fp8 checkpoint where no fp8 kernel runs: each weight dequantized to its parameter's dtype. That
is lossy against the trainer's weights (equal to a fresh load of the same fp8 checkpoint), so it
is only done when asked for, and says so.

A version that comes with the trainer's canary (``rlsync.Canary``) is checked once it is in the parameters and
before it serves: the module's own log-probs of the canary tokens (a forward, ``rlsync.causal_lm_logprobs``)
against the trainer's. A version that deviates is refused and the parameters get their previous values back
(kept in host memory for that, only while a version with a canary commits). With ``verify`` the parameters' own bytes
are checked after the copy too (a copy that missed one undoes the version the same way).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from rlsync import (
    ConfigError,
    Layout,
    RlsyncWarning,
    SyncOptions,
    WeightMismatchError,
    WeightsReader,
    causal_lm_logprobs,
)
from rlsync.core import HostStaging, same_bytes, synchronize_devices
from rlsync.layouts import from_state_dict
from rlsync.wire import SCALE_SUFFIX, dequantize, is_quantized, scale_shape


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

    def __init__(self, module: torch.nn.Module, src: Layout | None = None, *, options: SyncOptions | None = None,
                 landing: str = "staged") -> None:
        options = options or SyncOptions()
        if options.codec not in (None, "fp8"):
            raise ConfigError(f"ModuleReceiver: wire={options.wire!r} is not one it can load; use 'full', 'delta' or 'fp8'")
        if landing not in ("staged", "in_place"):
            raise ConfigError(f"ModuleReceiver: landing={landing!r}: use 'staged' (the default) or 'in_place'")
        if landing == "in_place" and options.codec is not None:
            raise ConfigError("ModuleReceiver(landing='in_place') lands the parameters' own bytes: use wire 'full'")
        self.module = module
        self.wire = "fp8" if options.codec == "fp8" else "full"
        self._params = dict(module.named_parameters())
        self._serving = threading.RLock()
        dst = module_layout(module)
        if self.wire == "fp8":
            from rlsync.wire import fp8_metas

            warnings.warn("ModuleReceiver(wire='fp8'): the module gets the fp8-dequantized weights (lossy against the "
                          "trainer's; what transformers loads from an fp8 checkpoint without fp8 kernels)", RlsyncWarning, stacklevel=2)
            dst = from_state_dict(fp8_metas(dst.tensors))
        if landing == "in_place":  # the writer writes the parameters themselves, the model paused meanwhile
            targets = {name: p.detach().reshape(-1).view(torch.uint8) for name, p in self._params.items()}
            self.reader = WeightsReader(src, dst, 0, options=options, landing="in_place", targets=targets, pause=self._pause,
                                        on_version=lambda version, buffers: self._check_canary())
            return
        # a version lands off to the side (one slot) and is copied into the parameters once complete: their
        # memory, on whatever device, never moves (CUDA graphs captured it), and no second model is held there
        self._previous = HostStaging()  # the parameters before a version with a canary, until it passed
        self.reader = WeightsReader(src, dst, 0, options=options, landing="staged", on_version=self._commit)

    def _pause(self, paused: bool) -> None:
        """In place: hold the model between forward passes (``serving``) while a version lands."""
        if paused:
            self._serving.acquire()
        else:
            self._serving.release()

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

    def _commit(self, version: int, buffers: dict[str, Any]) -> None:
        """Copy a landed version into the parameters, in place, between two forward passes (``serving``)."""

        checked = self.reader.landed_canary is not None and self.reader.options.canary
        verify = self.reader.options.verify
        with self._serving, torch.no_grad():
            if checked or verify:
                for name, p in self._params.items():
                    self._previous.stage(name, p.detach())
                self._previous.wait()
            for name, p in self._params.items():
                raw = torch.as_tensor(buffers[name])  # host staging (numpy) or device staging (a tensor): no copy
                if self.wire == "fp8" and is_quantized(name, tuple(p.shape)):  # dequantized on the parameter's device
                    scale = torch.as_tensor(buffers[name + SCALE_SUFFIX]).view(torch.float32).view(scale_shape(tuple(p.shape)))
                    q = raw.view(torch.float8_e4m3fn).view(p.shape).to(p.device)
                    p.copy_(dequantize(q, scale.to(p.device), p.dtype))
                else:
                    p.copy_(raw.view(p.dtype).view(p.shape))
            if checked or verify:
                try:
                    if verify:
                        self._check_live(buffers)
                    if checked:
                        self._check_canary()
                except Exception:
                    for name, p in self._params.items():
                        p.copy_(self._previous.buffers[name])
                    raise
            synchronize_devices(self._params.values())  # copied before the next forward, on whatever stream that runs

    def _check_live(self, buffers: dict[str, Any]) -> None:
        """Under ``verify``: each parameter's bytes, where the forward reads them, against the landed bytes (checked
        against the writer's checksums); fp8 weights are computed from theirs, so the canary is their check. Walks
        the module's own parameters, not the list the commit copied."""
        for name, p in self.module.named_parameters():
            if self.wire == "fp8" and is_quantized(name, tuple(p.shape)):
                continue
            if not same_bytes(p.detach(), torch.as_tensor(buffers[name])):
                raise WeightMismatchError(f"parameter {name!r} holds other bytes than the ones that landed (and matched the "
                                          f"trainer's checksums): the commit missed or misplaced them; version undone")

    def _check_canary(self) -> None:
        """The new version is in the parameters and does not serve yet: its canary log-probs against the trainer's."""
        with self._serving:
            self.reader.check_canary(lambda tokens: causal_lm_logprobs(self.module, tokens), where="the module")

    def close(self) -> None:
        """Stop receiving; the parameters keep the live version (their own memory)."""
        self.reader.close()

    def __enter__(self) -> ModuleReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
