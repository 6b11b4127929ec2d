"""A FAKE SGLang engine for tests: SGLang's engine needs CUDA and cannot run here.

It follows SGLang's weight-update contract (sgl-project/sglang, read for this fake):
- ``Engine.update_weights_from_tensor(named_tensors, load_format=None, flush_cache=True)``
  (``python/sglang/srt/entrypoints/engine.py``) returns ``(success, message)``; in each worker
  ``ModelRunner.update_weights_from_tensor`` (``python/sglang/srt/model_executor/model_runner.py``)
  dispatches on ``load_format``: ``"direct"``; a name listed in ``server_args.custom_weight_loader``
  is imported (``dynamic_import``) and called as ``loader(model, named_tensors)``; ``None`` calls
  ``model.load_weights(named_tensors)``; anything else raises ``NotImplementedError(f"Unknown
  load_format={load_format}")``, which the engine reports as ``(False, message)``.
- ``pause_generation`` / ``continue_generation``, ``update_weight_version(new_version,
  abort_all_requests=True)``, ``get_weight_version``, ``flush_cache``: the server routes of those
  names (``python/sglang/srt/entrypoints/http_server.py``).
The "model" is a real transformers model whose ``load_weights`` takes checkpoint-named tensors, as
SGLang's models do; generation is greedy decoding with it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

import torch


class FakeModel:
    """A transformers causal LM with SGLang's ``load_weights(iterable of (name, tensor))``."""

    def __init__(self, hf_model: torch.nn.Module) -> None:
        self.hf = hf_model
        self.params = dict(hf_model.named_parameters())

    def parameters(self) -> Iterable[torch.nn.Parameter]:  # SGLang's models are nn.Modules
        return self.hf.parameters()

    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        return self.hf.named_parameters()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                self.params[name].copy_(tensor)  # KeyError for an unknown name, as SGLang's params_dict[name]


class FakeSglangEngine:
    """FAKE: see the module docstring for the SGLang sources each method follows."""

    def __init__(self, model: FakeModel, custom_weight_loader: list[str] | None = None) -> None:
        self.model = model
        self.custom_weight_loader = list(custom_weight_loader or [])
        self.weight_version = "default"
        self.paused = False
        self.calls: list[str] = []

    def _dynamic_import(self, path: str) -> Any:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None = None,
                                   flush_cache: bool = True) -> tuple[bool, str]:
        self.calls.append("update_weights_from_tensor")
        try:
            if load_format == "direct":
                for name, tensor in named_tensors:
                    self.model.params[name].data.copy_(tensor)
            elif load_format in self.custom_weight_loader:
                self._dynamic_import(load_format)(self.model, named_tensors)
            elif load_format is None:
                self.model.load_weights(named_tensors)
            else:
                raise NotImplementedError(f"Unknown load_format={load_format}")
        except Exception as exc:  # noqa: BLE001 - SGLang reports failures as (False, message)
            return False, f"Failed to update weights: {exc}."
        if flush_cache:
            self.flush_cache()
        return True, "Success"

    def pause_generation(self) -> None:
        self.calls.append("pause_generation")
        self.paused = True

    def continue_generation(self) -> None:
        self.calls.append("continue_generation")
        self.paused = False

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        self.calls.append("update_weight_version")
        self.weight_version = new_version

    def get_weight_version(self) -> str:
        return self.weight_version

    def flush_cache(self) -> None:
        self.calls.append("flush_cache")

    def generate(self, input_ids: list[list[int]], sampling_params: dict[str, Any]) -> list[dict[str, Any]]:
        assert not self.paused, "generate while paused"
        assert sampling_params.get("temperature") == 0.0
        out = []
        with torch.no_grad():
            for ids in input_ids:
                seq = torch.tensor([ids])
                for _ in range(sampling_params["max_new_tokens"]):
                    nxt = self.model.hf(seq).logits[0, -1].argmax()
                    seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
                out.append({"output_ids": seq[0, len(ids):].tolist()})
        return out
