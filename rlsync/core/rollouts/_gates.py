"""Staleness gates and importance weights.

A gate looks at one sample and the trainer's current version and decides: train it, or drop it.
There is one mechanism, the ``rlsync_gate_sample`` hook: a plugin implements it for every buffer of the
process; ``RolloutBuffer(gates=[...])`` adds ``Gate`` objects for one buffer, asked first. A gate
returns ``Decision.DROP`` to drop, or ``TRAIN``/None to let the next gate decide; a sample that no
gate drops trains. Built in (``rlsync.plugins.gates``, asked last): ``MaxStaleness`` with the buffer's
``max_staleness``.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any, Protocol, runtime_checkable

import numpy as np

from rlsync.core._errors import ConfigError, whole_number
from rlsync.core.rollouts._samples import Sample


class Decision(Enum):
    TRAIN = "train"
    DROP = "drop"


@runtime_checkable
class Gate(Protocol):
    """A staleness gate for one buffer (``RolloutBuffer(gates=[...])``): called in the buffer's process when a
    sample is about to join a batch. Return ``Decision.DROP`` to drop it; ``Decision.TRAIN`` or None lets
    the other gates decide.

    Called on: the process that owns the buffer, once per sample, when a batch is formed.
    """

    def __call__(self, sample: Sample, trainer_version: int) -> Decision | None: ...


class MaxStaleness:
    """Drop a sample when its oldest token's version lags the trainer by more than ``max_staleness``."""

    name = "max_staleness"

    def __init__(self, max_staleness: int) -> None:
        self.max_staleness = whole_number("max_staleness", max_staleness, 0, "0: on-policy only")

    def __call__(self, sample: Sample, trainer_version: int) -> Decision:
        return Decision.TRAIN if self.keeps(sample.oldest_version, trainer_version) else Decision.DROP

    def keeps(self, oldest: Any, trainer_version: int) -> Any:
        """The verdict on oldest-token versions as they are: an int, or a numpy array or torch tensor of them (on
        whatever device: a trainer's batch is judged where it lives, without a copy to the host)."""
        return trainer_version - oldest <= self.max_staleness


def freshest_per_group(samples: Sequence[Sample], group_size: int) -> list[Sample]:
    """Of a group's samples (say a prompt regenerated after an abort), keep the ``group_size``
    whose oldest token is newest; ties keep arrival order."""
    order = sorted(range(len(samples)), key=lambda i: (-samples[i].oldest_version, i))
    keep = sorted(order[:group_size])
    return [samples[i] for i in keep]


def importance_weights(trainer_logprobs: np.ndarray, behaviour_logprobs: np.ndarray, cap: float | None = 2.0) -> np.ndarray:
    """Token-level importance ratios ``exp(trainer - behaviour)``, truncated at ``cap`` (truncated IS).

    Both arrays hold log-probabilities of the sampled tokens, one per generated token.
    """
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 < cap < float("inf")):
        raise ConfigError(f"cap={cap!r}: a ratio above 0 at which the weights are truncated (e.g. 2.0), or None")
    if trainer_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"log-prob shapes differ: trainer {trainer_logprobs.shape}, behaviour {behaviour_logprobs.shape}")
    ratio = np.exp(trainer_logprobs.astype(np.float64) - behaviour_logprobs.astype(np.float64))
    return np.minimum(ratio, cap) if cap is not None else ratio
