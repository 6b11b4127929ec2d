"""The sampling mask in verl's FSDP actor (installed through ``rlsync.patches.verl.apply_sampling_mask``).

With ``actor_rollout_ref.rollout.top_k``/``top_p`` set, verl's vLLM servers draw each token from the kept set,
renormalized, and report its log-prob under it (verl's default ``rollout.logprobs_mode=processed_logprobs``); verl's
actor scores the token under the full softmax (the temperature applied), so its rollout correction
(``old_log_prob - rollout_log_probs``) and the importance ratios built on it are biased low by the kept mass. Here:

- ``ActorRolloutRefWorker.__init__``: the worker keeps the rollout's top-k/top-p as its actor's mask (None where they
  do not truncate, where ``+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.rlsync.sampling_mask=false``,
  or where ``actor_rollout_ref.model.use_fused_kernels`` computes log-probs with no logits to mask: said once);
- its ``compute_log_prob`` and ``update_actor`` (the actor's, not the reference model's ``compute_ref_log_prob``, nor
  a LoRA actor's reference pass with its adapter off) mark their batch with that mask;
- ``FSDPEngineWithLMHead.forward_step`` scores a marked micro-batch under it: the engine module's
  ``logprobs_from_logits`` is ``rlsync.logits_logprobs`` (a chunk of rows at a time, the backward in closed form)
  while the step runs, and its entropy (a metric, and a loss term with ``entropy_coeff``) is the masked distribution's:
  the engine's ``compute_entropy_from_logits`` and ``verl.utils.torch_functional``'s ``entropy_from_logits`` (the
  padded path's) are, for the step, functions that hold the mask themselves, so that ``entropy_checkpointing``'s
  recomputation in the backward (after the step returned) computes the same masked entropy.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any

_log = logging.getLogger("rlsync")
KEY = "rlsync_sampling_mask"  # the batch's non-tensor entry: [top_k or None, top_p or None]
_ACTIVE: contextvars.ContextVar[tuple[int | None, float | None] | None] = contextvars.ContextVar(
    "rlsync_verl_sampling_mask", default=None)


def mask_of(config: Any) -> tuple[int | None, float | None] | None:
    """The actor's mask from its worker's ``actor_rollout_ref`` config (None: none to reapply)."""
    from omegaconf import OmegaConf

    top_k = OmegaConf.select(config, "rollout.top_k", default=-1)
    top_p = OmegaConf.select(config, "rollout.top_p", default=1.0)
    mask = (int(top_k) if top_k and top_k > 0 else None, float(top_p) if top_p is not None and top_p < 1.0 else None)
    if mask == (None, None):
        return None
    if OmegaConf.select(config, "rollout.checkpoint_engine.engine_kwargs.rlsync.sampling_mask", default=True) is False:
        _log.warning("rlsync: sampling_mask=false: the actor scores tokens sampled with top_k=%s, top_p=%s under the "
                     "full distribution (importance ratios biased low by the kept mass)", *mask)
        return None
    if OmegaConf.select(config, "model.use_fused_kernels", default=False):
        _log.warning("rlsync: the rollout samples with top_k=%s, top_p=%s, but actor_rollout_ref.model.use_fused_kernels"
                     "=True computes log-probs with no logits to mask: set it to False for exact importance ratios", *mask)
        return None
    return mask


def wrap_worker_init(original: Any) -> Any:
    """``ActorRolloutRefWorker.__init__``: the worker keeps its actor's mask."""

    @functools.wraps(original)
    def __init__(self: Any, config: Any, role: str, *args: Any, **kwargs: Any) -> None:
        original(self, config, role, *args, **kwargs)
        self.rlsync_sampling_mask = mask_of(config)
        if self.rlsync_sampling_mask is not None:
            _log.info("rlsync: the actor's log-probs reapply the sampling mask (top_k=%s, top_p=%s)", *self.rlsync_sampling_mask)

    return __init__


def wrap_actor_call(original: Any) -> Any:
    """The worker's ``compute_log_prob`` and ``update_actor``: their batch carries the actor's mask (verl's
    ``@register`` attributes kept by ``functools.wraps``)."""

    @functools.wraps(original)
    def call(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        mask = getattr(self, "rlsync_sampling_mask", None)
        if mask is not None and not tu.get(data, key="no_lora_adapter", default=False):  # not a reference pass
            tu.assign_non_tensor_data(data, KEY, list(mask))
        return original(self, data, *args, **kwargs)

    return call


def wrap_forward_step(original: Any) -> Any:
    """``FSDPEngineWithLMHead.forward_step``: a marked micro-batch scores under its mask."""

    @functools.wraps(original)
    def forward_step(self: Any, micro_batch: Any, *args: Any, **kwargs: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        mask = tu.get_non_tensor_data(data=micro_batch, key=KEY, default=None)
        if mask is None:
            return original(self, micro_batch, *args, **kwargs)
        from verl.utils import torch_functional

        from rlsync import masked_entropy

        def entropy(logits: Any, chunk_size: int | None = None) -> Any:  # verl's chunked variant's chunk_size: not needed
            return masked_entropy(logits, top_k=mask[0], top_p=mask[1])

        token = _ACTIVE.set((mask[0], mask[1]))
        engine_entropy = self.__dict__.get("compute_entropy_from_logits")
        padded_entropy = torch_functional.entropy_from_logits
        self.compute_entropy_from_logits, torch_functional.entropy_from_logits = entropy, entropy
        try:
            return original(self, micro_batch, *args, **kwargs)
        finally:
            _ACTIVE.reset(token)
            torch_functional.entropy_from_logits = padded_entropy
            if engine_entropy is None:
                del self.compute_entropy_from_logits
            else:
                self.compute_entropy_from_logits = engine_entropy

    return forward_step


def masked_log_probs(original: Any) -> Any:
    """The engine module's ``logprobs_from_logits``: under the mask while a marked step runs."""

    @functools.wraps(original)
    def logprobs_from_logits(logits: Any, labels: Any, *args: Any, **kwargs: Any) -> Any:
        mask = _ACTIVE.get()
        if mask is None:
            return original(logits, labels, *args, **kwargs)
        from rlsync import logits_logprobs

        return logits_logprobs(logits, labels, top_k=mask[0], top_p=mask[1])[0]

    return logprobs_from_logits
