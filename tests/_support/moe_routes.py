"""Helpers of the routing-replay tests: a transformers causal LM's log-probs of its own input tokens (with gradients),
and the experts its routers pick themselves."""

from __future__ import annotations

import numpy as np
import torch

from rlsync.adapters.hf import RouteLog, replay_routes


def token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """log p(``ids[:, j + 1]`` | ``ids[:, : j + 1]``), ``[batch, seq - 1]``, differentiable (``rlsync.causal_lm_logprobs``
    is the no-grad form)."""
    logits = model(ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def own_routes(model: torch.nn.Module, ids: torch.Tensor, layers: int, top_k: int) -> np.ndarray:
    """The experts ``model``'s routers pick for every token of ``ids``: ``[batch, seq, layers, top_k]`` (a replay
    with nothing recorded, which logs the routers' own picks)."""
    with torch.no_grad(), replay_routes(model, np.full((*ids.shape, layers, top_k), -1)) as log:
        model(ids)
    return torch.stack([p.view(*ids.shape, top_k) for p in log.picked], 2).numpy()  # type: ignore[union-attr]


def with_and_without_replay(model: torch.nn.Module, ids: torch.Tensor,
                            recorded: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, RouteLog, list[torch.Tensor]]:
    """``model``'s token log-probs of ``ids`` routing itself and replaying ``recorded``; the replay's log; and, per MoE
    layer, the experts its experts module was given under replay (``[tokens, top_k]``)."""
    used: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda m, args, out: used.append(args[1].clone()))
             for m in model.modules() if type(m).__name__.endswith("Experts")]
    try:
        with torch.no_grad():
            without = token_logprobs(model, ids)
            used.clear()
            with replay_routes(model, recorded) as log:
                with_replay = token_logprobs(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return without, with_replay, log, used
