"""The sampling mask in OpenRLHF's actor (``rlsync launch openrlhf``; ``--sampling-mask off`` turns it off).

With ``--rollout.top_p`` below 1, OpenRLHF's vLLM engines draw each token from the kept set, renormalized, and report
its log-prob under it (OpenRLHF asks for ``processed_logprobs`` where its importance-sampling correction is on); its
actor scores the token under the full softmax (temperature applied), so the correction's ratio
``old_log_probs - rollout_log_probs`` is biased low by the kept mass on every token. Here the policy's ``Actor``
(the one ``PolicyModelActor`` builds; not the reference model, not the EMA copy) scores under the same mask: while its
``forward`` runs, the actor module's ``log_probs_from_logits`` and ``compute_entropy`` are ``rlsync.logits_logprobs``'s
(a chunk of rows at a time, the backward in closed form), old log-probs and the loss's alike. OpenRLHF 0.11 has no
top-k option for its rollouts (its samples generator asks vLLM with ``top_k=-1``): top-p alone is reapplied.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any

from rlsync.patches.openrlhf import options

_log = logging.getLogger("rlsync")
#: (top_k, top_p) the policy's forward scores under while it runs
_ACTIVE: contextvars.ContextVar[tuple[int | None, float | None] | None] = contextvars.ContextVar(
    "rlsync_openrlhf_sampling_mask", default=None)


def mask_of(args: Any, wanted: str) -> tuple[int | None, float | None] | None:
    """The mask OpenRLHF's arguments sample with (None: they do not truncate, or ``wanted`` is ``off``)."""
    top_p = float(getattr(args.rollout, "top_p", 1.0))
    if wanted == "off" or top_p >= 1.0:
        return None
    return None, top_p


def wrap_policy_init(init: Any) -> Any:
    """``PolicyModelActor.init_model_from_pretrained``: the policy's ``Actor``, once built, scores under the mask."""

    @functools.wraps(init)
    def init_model_from_pretrained(self: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
        result = init(self, strategy, *args, **kwargs)
        mask = mask_of(strategy.args, str((options() or {}).get("sampling_mask", "auto")))
        self.actor.rlsync_sampling_mask = mask
        if mask is not None:
            _log.info("rlsync: the actor's log-probs reapply the sampling mask (top_p=%s)", mask[1])
        return result

    return init_model_from_pretrained


def wrap_forward(forward: Any) -> Any:
    """``Actor.forward``: under the actor's mask, where it has one."""

    @functools.wraps(forward)
    def actor_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        mask = getattr(self, "rlsync_sampling_mask", None)
        if mask is None:
            return forward(self, *args, **kwargs)
        token = _ACTIVE.set(mask)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    return actor_forward


def masked_log_probs(original: Any) -> Any:
    """The actor module's ``log_probs_from_logits``: under the mask while the policy's forward runs."""

    @functools.wraps(original)
    def log_probs_from_logits(logits: Any, labels: Any, temperature: float = 1.0) -> Any:
        mask = _ACTIVE.get()
        if mask is None:
            return original(logits, labels, temperature)
        from rlsync import logits_logprobs

        scaled = logits if temperature == 1.0 else logits / temperature  # the actor divides before it calls this
        return logits_logprobs(scaled, labels, top_k=mask[0], top_p=mask[1])[0]

    return log_probs_from_logits


def masked_entropy(original: Any) -> Any:
    """The actor module's ``compute_entropy``: the masked distribution's while the policy's forward runs."""

    @functools.wraps(original)
    def compute_entropy(logits: Any) -> Any:
        mask = _ACTIVE.get()
        if mask is None:
            return original(logits)
        from rlsync import masked_entropy

        return masked_entropy(logits, top_k=mask[0], top_p=mask[1])

    return compute_entropy
