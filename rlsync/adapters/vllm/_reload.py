"""vLLM's layerwise reload, plus the post-load steps it skips on an update.

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

from typing import Any, Self


def _experts_kernel(module: Any) -> Any:
    method = getattr(module, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


class reprocessing_skipped_steps:
    """Wrap one layerwise reload of ``model`` (vLLM's or ours): redo what it skips on an update.

    ``with reprocessing_skipped_steps(model): <reload>``; or ``enter()`` before the reload starts and
    ``exit(ok)`` after it ends when the two happen in different calls (vLLM's weight-transfer API).
    """

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

    def __enter__(self) -> Self:
        self.enter()
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.exit(ok=exc_type is None)


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
