"""The sampling mask, reapplied in the trainer: top-k and top-p change the action space a token was drawn from.

An engine that samples with ``top_k``/``top_p`` draws each token from the renormalized kept set, and reports the
log-prob under it (vLLM with ``logprobs_mode="processed_logprobs"``). A trainer that scores the same token under
its full softmax gets a log-prob lower by the log of the kept mass, so the importance weight ``exp(trainer -
behaviour)`` is biased low for every token of a sampled batch, not by a difference of policies. Reapplying the same
mask to the trainer's logits gives the log-prob under the same action space.

The mask follows vLLM's sampler (``vllm/v1/sample``, read for its order of operations): temperature first, then
min-p (tokens less likely than ``min_p`` times the most likely are dropped: vLLM's ``MinPLogitsProcessor``), then
top-k (tokens whose logit is below the k-th largest are dropped), then top-p on what is left (a token is kept while
the probability mass ranked strictly above it is below ``top_p``; the most likely token is always kept). Recorded
compactly per token as the kept-set size (``kept_sizes``); the trainer rebuilds a mask of that size from its own
logits (``kept=``), which tolerates the small logit differences between the two sides' kernels.

A trainer that never materializes its logits (a fused LM head: TRL's ``GRPOTrainer``) scores through
``head_logprobs``: the same mask from its hidden states and LM head, a few rows at a time, each chunk recomputed in the
backward, so memory stays at one chunk's logits (``_CHUNK_ELEMENTS``) whatever the batch.

Torch ops on whatever device the logits live on.
"""

from __future__ import annotations

from typing import Any, Final

import torch

#: logits of one chunk of ``head_logprobs`` (rows x vocab): 64 MiB of float32; the top-p sort adds twice that
_CHUNK_ELEMENTS: Final = 2**24
#: the most likely tokens top-p looks at before it sorts a whole row
_TOP_P_PREFIX: Final = 1024


def sampling_mask(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
                  kept: torch.Tensor | None = None, min_p: float | None = None) -> torch.Tensor:
    """Which tokens the sampler could draw, per position: a bool tensor shaped like ``logits`` (``[..., vocab]``;
    temperature already applied). ``kept`` (one size per position, e.g. recorded at generation): the top-``kept``
    tokens instead of ``top_k``/``top_p``/``min_p``."""
    if kept is not None:
        order = logits.argsort(dim=-1, descending=True)
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(logits.shape[-1], device=logits.device).expand_as(order))
        return ranks < kept.to(logits.device).unsqueeze(-1)
    keep = torch.ones_like(logits, dtype=torch.bool)
    if min_p is not None and min_p > 0.0:
        probs = logits.float().softmax(dim=-1)
        keep = probs >= probs.amax(dim=-1, keepdim=True) * min_p
        logits = logits.masked_fill(~keep, float("-inf"))  # top-k and top-p see what min-p left, as in vLLM
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        values, order = logits.topk(top_k, dim=-1)  # sorted, largest first
        keep &= logits >= values[..., -1:]
        if top_p is not None and top_p < 1.0 and bool((keep.sum(-1) == top_k).all()):
            # no ties at the k-th value: top-p over the k values alone, a sort of k instead of the vocabulary
            return torch.zeros_like(keep).scatter_(-1, order, _top_p_kept(values.float().softmax(dim=-1), top_p))
    if top_p is not None and top_p < 1.0:
        probs = logits.masked_fill(~keep, float("-inf")).float().softmax(dim=-1)
        keep &= _top_p_mask(probs.reshape(-1, probs.shape[-1]), top_p).view(keep.shape)
    return keep


def _top_p_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p over rows of probabilities ``[rows, V]``. A trained model's top-p set is usually a few hundred tokens:
    the ``_TOP_P_PREFIX`` most likely first, and the whole sort only for rows whose set reaches past them."""
    keep = torch.zeros_like(probs, dtype=torch.bool)
    rows = torch.arange(probs.shape[0], device=probs.device)
    if _TOP_P_PREFIX < probs.shape[-1]:
        top, order = probs.topk(_TOP_P_PREFIX, dim=-1)  # sorted, largest first
        kept = _top_p_kept(top, top_p)
        inside = ~kept[:, -1]  # the set ends before the prefix does: the prefix decides the row
        keep[inside] = torch.zeros_like(keep[inside]).scatter_(-1, order[inside], kept[inside])
        rows = rows[~inside]
    if rows.numel():
        sorted_probs, order = probs[rows].sort(dim=-1, descending=True)
        keep[rows] = torch.zeros_like(keep[rows]).scatter_(-1, order, _top_p_kept(sorted_probs, top_p))
    return keep


def _top_p_kept(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Of probabilities sorted largest first: kept while the mass ranked strictly above is below ``top_p``."""
    kept = sorted_probs.cumsum(dim=-1) - sorted_probs < top_p
    kept[..., 0] = True  # the most likely token always stays
    return kept


def masked_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None, kept: torch.Tensor | None = None,
                    min_p: float | None = None) -> torch.Tensor:
    """log p(``tokens``) under the sampler's renormalized distribution: ``logits`` ``[..., vocab]`` (raw), ``tokens``
    ``[...]``. A token outside the mask gets ``-inf`` (it could not have been sampled)."""
    scaled = logits.float() / temperature
    mask = sampling_mask(scaled, top_k=top_k, top_p=top_p, kept=kept, min_p=min_p)
    return scaled.masked_fill(~mask, float("-inf")).log_softmax(dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def kept_sizes(processed_logprobs: torch.Tensor) -> torch.Tensor:
    """The kept-set size per position from an engine's processed log-probs over the whole vocabulary (or its top-N
    entries, when fewer than N survived the mask): how many are finite."""
    return torch.isfinite(processed_logprobs).sum(dim=-1)


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor, *,
                  temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                  logit_scale: float = 1.0, softcap: float | None = None, entropy: bool = False,
                  min_p: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``masked_logprobs`` of ``tokens`` ``[N]`` from ``hidden`` ``[N, H]`` and an LM head (``weight`` ``[V, H]``,
    ``bias``), and with ``entropy`` the entropy of each position's masked distribution; differentiable. The logits
    are ``hidden @ weight.T + bias`` (in autocast's dtype where it is on), times ``logit_scale``, soft-capped, over
    ``temperature``: TRL's fused head's order. Each sampled token counts as kept even where the trainer's logits
    would put it just outside the set (its kernels round differently from the engine's): a log-prob, never -inf.

    Rows go ``_CHUNK_ELEMENTS // V`` at a time; the backward computes each chunk's logits again and their gradient
    in closed form, into one float32 gradient of the head: memory of a chunk's logits and of that gradient."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    with torch.autocast(device, enabled=False):
        logprobs, entropies = _MaskedHead.apply(hidden, weight, bias, tokens, dtype,  # type: ignore[no-untyped-call]
                                                (temperature, top_k, top_p, logit_scale, softcap, min_p), entropy)
    return logprobs, entropies if entropy else None


class _MaskedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
                dtype: torch.dtype, sampler: tuple[Any, ...], entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropies = torch.empty(hidden.shape[0] if entropy else 0, dtype=torch.float32, device=hidden.device)
        for rows, _, keep, logp in _chunks(hidden, weight, bias, tokens, dtype, sampler):
            _outputs(rows, keep, logp, tokens, logprobs, entropies)
        ctx.save_for_backward(hidden, weight, bias, tokens, entropies)
        ctx.dtype, ctx.sampler = dtype, sampler
        ctx.set_materialize_grads(False)
        return logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropies: torch.Tensor | None) -> Any:
        hidden, weight, bias, tokens, entropies = ctx.saved_tensors
        temperature, _, _, logit_scale, softcap, _ = ctx.sampler
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias and bias is not None else None
        for rows, y, keep, logp in _chunks(hidden, weight, bias, tokens, ctx.dtype, ctx.sampler):
            grad = _grad_of_logits(rows, keep, logp, tokens, grad_logprobs, grad_entropies, entropies)
            grad /= temperature  # back through the temperature, the cap and the scale to the head's output
            if softcap is not None:
                grad *= 1 - torch.tanh(y * logit_scale / softcap) ** 2
            grad *= logit_scale
            if grad_hidden is not None:  # in the head's compute dtype, as its forward (no float32 copy of the head)
                grad_hidden[rows] = grad.to(ctx.dtype) @ weight.to(ctx.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad.T, hidden[rows].float())
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        return _as(grad_hidden, hidden), _as(grad_weight, weight), _as(grad_bias, bias), None, None, None, None


def _as(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    """A float32 gradient in its input's dtype."""
    return None if grad is None or like is None else grad.to(like.dtype)


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tokens: torch.Tensor,
            dtype: torch.dtype, sampler: tuple[Any, ...]) -> Any:
    """Per chunk of rows: the rows, the head's output (float32, before scale, cap and temperature), the kept set (the
    sampled token in it) and the masked log-probs."""
    temperature, top_k, top_p, logit_scale, softcap, min_p = sampler
    with torch.no_grad():
        for rows in _row_chunks(hidden.shape[0], weight.shape[0]):
            y = torch.nn.functional.linear(hidden[rows].to(dtype), weight.to(dtype),
                                           None if bias is None else bias.to(dtype)).float()
            z = y * logit_scale
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            z /= temperature
            yield rows, y, *_masked(z, tokens[rows], top_k, top_p, min_p)


def _masked(z: torch.Tensor, tokens: torch.Tensor, top_k: int | None, top_p: float | None,
            min_p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept set of rows of float32 logits ``z`` (each row's sampled token in it) and their masked log-probs."""
    keep = sampling_mask(z, top_k=top_k, top_p=top_p, min_p=min_p)
    keep.scatter_(-1, tokens.unsqueeze(-1), True)
    return keep, z.masked_fill(~keep, float("-inf")).log_softmax(dim=-1)


def _row_chunks(count: int, vocab: int) -> Any:
    """Slices of ``count`` rows, ``_CHUNK_ELEMENTS // vocab`` at a time."""
    step = max(1, _CHUNK_ELEMENTS // vocab)
    return (slice(start, start + step) for start in range(0, count, step))


def _outputs(rows: slice, keep: torch.Tensor, logp: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
             entropies: torch.Tensor) -> None:
    """A chunk's chosen log-probs into ``logprobs``, and its entropies into ``entropies`` where they are wanted."""
    logprobs[rows] = logp.gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
    if entropies.numel():
        kept = logp.masked_fill(~keep, 0.0)  # a dropped token adds exp(0) * 0
        entropies[rows] = -(kept.exp() * kept).sum(-1)


def _grad_of_logits(rows: slice, keep: torch.Tensor, logp: torch.Tensor, tokens: torch.Tensor,
                    grad_logprobs: torch.Tensor | None, grad_entropies: torch.Tensor | None,
                    entropies: torch.Tensor) -> torch.Tensor:
    """The gradient of a chunk's chosen log-probs (and entropies, where computed) with respect to its masked logits,
    in closed form; the other arguments whole, ``rows`` the chunk's."""
    p = logp.exp()  # 0 where dropped
    grad = torch.zeros_like(p)
    if grad_logprobs is not None:  # d log p_t / d z_j = [j = t] - p_j
        g = grad_logprobs[rows].unsqueeze(-1)
        grad -= g * p
        grad.scatter_add_(-1, tokens[rows].unsqueeze(-1), g)
    if grad_entropies is not None and entropies.numel():  # d H / d z_j = -p_j (log p_j + H)
        grad -= grad_entropies[rows].unsqueeze(-1) * p * (logp.masked_fill(~keep, 0.0) + entropies[rows].unsqueeze(-1))
    return grad


def logits_logprobs(logits: torch.Tensor, tokens: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
                    entropy: bool = False, min_p: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What a trainer that holds its logits ``[..., V]`` (temperature already applied) scores the sampled ``tokens``
    ``[...]`` with: their log-probs under the top-k/top-p mask, and with ``entropy`` each position's masked entropy;
    differentiable. Unlike ``masked_logprobs``, the sampled token always counts as kept (never -inf), the mask is made
    ``_CHUNK_ELEMENTS`` at a time and the backward recomputes it: memory of one chunk beside the logits' gradient."""
    flat, ids = logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)
    logprobs, entropies = _MaskedLogits.apply(flat, ids, (top_k, top_p, min_p), entropy)  # type: ignore[no-untyped-call]
    return logprobs.view(tokens.shape), entropies.view(tokens.shape) if entropy else None


def masked_entropy(logits: torch.Tensor, *, top_k: int | None = None, top_p: float | None = None,
                   min_p: float | None = None) -> torch.Tensor:
    """Each position's entropy under the sampler's mask (``logits`` ``[..., V]``, temperature applied), differentiable,
    chunked as ``logits_logprobs``: what an actor that logs or regularizes its entropy uses where its log-probs are
    masked. (Scored at the most likely token, which every mask keeps, so the set is the mask alone.)"""
    entropy = logits_logprobs(logits, logits.argmax(-1), top_k=top_k, top_p=top_p, min_p=min_p, entropy=True)[1]
    assert entropy is not None
    return entropy


class _MaskedLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, sampler: tuple[Any, ...],
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = torch.empty(tokens.shape[0], dtype=torch.float32, device=logits.device)
        entropies = torch.empty(tokens.shape[0] if entropy else 0, dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            for rows in _row_chunks(tokens.shape[0], logits.shape[-1]):
                _outputs(rows, *_masked(logits[rows].float(), tokens[rows], *sampler), tokens, logprobs, entropies)
        ctx.save_for_backward(logits, tokens, entropies)
        ctx.sampler = sampler
        ctx.set_materialize_grads(False)
        return logprobs, entropies

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropies: torch.Tensor | None) -> Any:
        logits, tokens, entropies = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _row_chunks(tokens.shape[0], logits.shape[-1]):
            keep, logp = _masked(logits[rows].float(), tokens[rows], *ctx.sampler)
            grad_logits[rows] = _grad_of_logits(rows, keep, logp, tokens, grad_logprobs, grad_entropies, entropies)
        return grad_logits, None, None, None
