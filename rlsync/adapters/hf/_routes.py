"""Routing replay for transformers MoE models ("keep routing"): the training forward sends each token to the experts
the generator sent it to, so that the trainer's log-probs (and their gradients) are of the computation that sampled
the tokens. Without it, weights that moved a step (or the engine's other kernels and dtype) route some tokens to
other experts, and the importance weights compare two different networks.

The patch point is the router: every ``*TopKRouter`` module of the model (transformers 5: Qwen3-MoE, OLMoE,
Mixtral, and the other MoE models built the same way) picks its experts with one call,
``torch.topk(router_probs, top_k, dim=-1)``. Inside a router's forward (and nowhere else) ``replay_routes`` answers
that call with the recorded experts and their probabilities under the current weights; what the router does next
(normalisation, dtype) and the experts are the model's own code, and the router still gets gradients through the
probabilities of the experts it is made to use. Tokens without a record (an entry < 0) keep the router's own pick.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from rlsync import ConfigError, Sample


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers, in layer order."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RouteLog:
    """What a ``replay_routes`` forward saw: ``picked[layer]``, the experts each router would have picked itself
    (``[tokens, top_k]``, tokens flattened over the batch); ``differing``, how many recorded tokens (summed over
    layers) it would have sent to another set of experts than the record."""

    def __init__(self, layers: int) -> None:
        self.picked: list[torch.Tensor | None] = [None] * layers
        self.differing = 0
        self.replayed = 0


class _RecordedTopk(TorchFunctionMode):
    """Answers ``torch.topk`` with the recorded experts, for the rows that have a record."""

    def __init__(self, recorded: torch.Tensor, log: RouteLog, layer: int) -> None:
        super().__init__()
        self.recorded, self.log, self.layer = recorded, log, layer

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.topk:
            return func(*args, **kwargs)
        own = func(*args, **kwargs)
        probs = args[0]
        recorded = self.recorded.to(probs.device)
        if recorded.shape != own.indices.shape:
            raise ConfigError(f"MoE layer {self.layer} routes {tuple(own.indices.shape)} (tokens, top_k) in this "
                              f"forward; the recorded routes give {tuple(recorded.shape)}: give replay_routes "
                              f"[batch, seq, layers, top_k] of exactly the forward's input ids")
        has = (recorded >= 0).all(-1)
        indices = torch.where(has[:, None], recorded, own.indices)
        self.log.picked[self.layer] = own.indices.detach()
        mine, theirs = own.indices.sort(-1).values, recorded.sort(-1).values
        self.log.differing += int(((mine != theirs).any(-1) & has).sum())
        self.log.replayed += int(has.sum())
        return torch.return_types.topk((probs.gather(-1, indices), indices))


@contextmanager
def replay_routes(model: torch.nn.Module, routes: torch.Tensor | np.ndarray) -> Iterator[RouteLog]:
    """Within the block, ``model``'s forward routes token ``[b, s]`` of MoE layer ``l`` to the experts
    ``routes[b, s, l]`` (``[batch, seq, layers, top_k]``, the shape of the forward's input ids plus the record; an
    entry < 0 leaves that token to its router). ``routes_of(samples, width)`` builds it from rollout samples.
    Yields a ``RouteLog``: what the routers would have picked themselves."""
    found = routers(model)
    if not found:
        raise ConfigError(f"{type(model).__name__} has no MoE router (no module named *TopKRouter): routing replay is "
                          f"for transformers MoE models (Qwen3-MoE, OLMoE, Mixtral, ...)")
    routes = torch.as_tensor(np.asarray(routes) if not isinstance(routes, torch.Tensor) else routes).long()
    top_k = int(getattr(found[0], "top_k", routes.shape[-1]))
    if routes.ndim != 4 or routes.shape[2] != len(found) or routes.shape[3] != top_k:
        raise ConfigError(f"routes of shape {tuple(routes.shape)}: give [batch, seq, {len(found)} MoE layers, top_k "
                          f"{top_k}] for {type(model).__name__}")
    log = RouteLog(len(found))
    flat = routes.reshape(-1, len(found), top_k)
    modes: list[_RecordedTopk] = []

    def enter(layer: int) -> Any:
        def pre(module: torch.nn.Module, args: Any) -> None:
            mode = _RecordedTopk(flat[:, layer], log, layer)
            mode.__enter__()  # type: ignore[no-untyped-call]
            modes.append(mode)
        return pre

    def leave(module: torch.nn.Module, args: Any, output: Any) -> None:
        modes.pop().__exit__(None, None, None)  # type: ignore[no-untyped-call]

    handles = []
    for layer, router in enumerate(found):
        handles.append(router.register_forward_pre_hook(enter(layer)))
        handles.append(router.register_forward_hook(leave, always_call=True))
    try:
        yield log
    finally:
        for handle in handles:
            handle.remove()
        while modes:  # a forward that failed inside a router
            modes.pop().__exit__(None, None, None)  # type: ignore[no-untyped-call]


class HeldReplay:
    """One ``replay_routes`` block held open across calls: a training loop opens it in a forward and closes it once
    that forward's backward is done (at the next forward, or when its step returns), because a gradient-checkpointed
    layer runs its forward again in the backward and must route as the forward did. What framework adapters hook."""

    def __init__(self) -> None:
        self._active: tuple[AbstractContextManager[RouteLog], RouteLog] | None = None

    @property
    def is_open(self) -> bool:
        return self._active is not None

    def open(self, model: torch.nn.Module, routes: torch.Tensor | np.ndarray) -> RouteLog:
        """Close the one held (if any), then open ``replay_routes(model, routes)``; its log fills as forwards run."""
        self.close()
        replay = replay_routes(model, routes)
        self._active = replay, replay.__enter__()
        return self._active[1]

    def close(self) -> RouteLog | None:
        """End the held replay; its log (None: none was open)."""
        if self._active is None:
            return None
        replay, log = self._active
        self._active = None
        replay.__exit__(None, None, None)
        return log


def token_rows(ids: torch.Tensor, mask: torch.Tensor | None = None) -> np.ndarray:
    """A forward's input ids on the host, masked columns as -1: one copy per forward, because routes are found by
    the tokens a row holds (the engine's request ids never reach the trainer)."""
    return (ids if mask is None else ids.masked_fill(mask == 0, -1)).detach().cpu().numpy()


def routes_at_rows(rows: np.ndarray, records: Sequence[np.ndarray | None], layers: int,
                   top_k: int) -> tuple[np.ndarray, int]:
    """``[batch, seq, layers, top_k]`` routes for ``rows`` (``token_rows``): row ``i``'s record (or None) on its
    unmasked columns from the first, -1 elsewhere; and how many rows had a record."""
    out = np.full((*rows.shape, layers, top_k), -1, dtype=np.int64)
    found = 0
    for i, record in enumerate(records):
        if record is not None:
            columns = np.flatnonzero(rows[i] >= 0)[: len(record)]
            out[i, columns] = record[: len(columns)]
            found += 1
    return out, found


def routes_of(samples: Sequence[Sample], width: int) -> np.ndarray:
    """``[len(samples), width, layers, top_k]`` routes for a right-padded batch of ``samples`` (their ``routes``):
    each sample's record at the positions it covers (``rlsync.Sample``: its rows end at the second-to-last token),
    -1 elsewhere (padding, the last token, the prompt when only the generated tokens' steps were recorded): those
    positions keep the trainer's own routing."""
    recorded = [s for s in samples if s.routes is not None]
    if not recorded:
        raise ConfigError("none of these samples carries routes: record them at generation (Sample(routes=...))")
    layers, top_k = recorded[0].routes.shape[1:]  # type: ignore[union-attr]
    out = np.full((len(samples), width, layers, top_k), -1, dtype=np.int64)
    for i, s in enumerate(samples):
        if s.routes is not None:
            end = len(s.tokens) - 1
            out[i, end - len(s.routes) : end] = s.routes
    return out
