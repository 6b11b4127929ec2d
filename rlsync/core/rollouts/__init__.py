"""Rollouts: samples with a policy version on every token, the buffer between generators and trainers, and the
gates that bound staleness.

Owns the sample record (versions, sampling masks, routed experts), the rollout buffer and its storage contract,
the staleness gates and importance weights, durable episodes, the sampling mask's log-probs and the buffer's
telemetry. It may import ``layouts`` and ``hooks`` (buffer backends are plugins), never ``sync``: rollouts and
weights meet only in the adapters.
"""

from __future__ import annotations

from rlsync.core.rollouts._buffer import Batch, MemoryStorage, RolloutBuffer, Storage, Ticket
from rlsync.core.rollouts._episodes import Claim, Episode, EpisodeLog, MemoryEpisodes, Turn
from rlsync.core.rollouts._gates import Decision, Gate, MaxStaleness, freshest_per_group, importance_weights
from rlsync.core.rollouts._samples import PolicyVersionClock, Sample, decode_sample, encode_sample
from rlsync.core.rollouts._sampling_mask import head_logprobs, kept_sizes, logits_logprobs, masked_entropy, masked_logprobs, sampling_mask
from rlsync.core.rollouts._make_buffer import make_buffer

__all__ = ["Batch", "Claim", "Decision", "Episode", "EpisodeLog", "Gate", "MaxStaleness", "MemoryEpisodes", "MemoryStorage", "PolicyVersionClock", "RolloutBuffer", "Sample", "Storage", "Ticket", "Turn", "decode_sample", "encode_sample", "freshest_per_group", "head_logprobs", "importance_weights", "kept_sizes", "logits_logprobs", "make_buffer", "masked_entropy", "masked_logprobs", "sampling_mask"]
