"""Policy versions on OpenRLHF's samples, and rlsync's staleness gate before training (launcher ``--max-staleness``).

OpenRLHF's samples carry no version. A named Ray actor (``VersionClock``) holds the version the engines serve:
trainer rank 0 sets it after every sync (``_trainer.broadcast_to_vllm``). The patched
``SamplesGenerator.generate_samples`` reads it before and after generating and stamps every sample
(``Experience.rlsync_versions = (oldest, newest)``: with ``--train.partial_rollout_enable`` a sync may land
mid-generation, otherwise OpenRLHF's lock keeps both equal). The patched ``BasePPOTrainer.train_step`` drops,
with rlsync's ``MaxStaleness`` gate, every sample whose oldest token lags the live version by more than
``max_staleness`` before OpenRLHF turns the samples into experiences, and reports ``rlsync/staleness_mean`` and
``rlsync/dropped_stale`` in the step's status, and the last sync's ``rlsync/canary_deviation`` when its canary was
checked. With the launcher's ``--timeline`` both record what they see: each generation phase (``request``), each
batch's staleness (``batch``), drops and the train step (``train``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from rlsync import Decision, MaxStaleness, Sample
from rlsync.core import recording, span

CLOCK = "rlsync-openrlhf-version-clock"


class VersionClock:
    """The weight version OpenRLHF's vLLM engines serve (0: the checkpoint they started from)."""

    def __init__(self) -> None:
        self.version = 0
        self.canary_deviation: float | None = None

    def set(self, version: int, canary_deviation: float | None = None) -> None:  # trainer rank 0 only, after each sync
        self.version, self.canary_deviation = int(version), canary_deviation

    def get(self) -> int:
        return self.version

    def get_with_canary(self) -> tuple[int, float | None]:
        return self.version, self.canary_deviation


_handle: list[Any] = []  # held for the life of this process: Ray collects an actor no handle refers to


def clock(*, new_cluster: bool = False) -> Any:
    """The run's clock (created by whoever asks first). ``new_cluster``: this process started Ray again (the launcher's
    driver), and a handle it kept belongs to the cluster before."""
    import ray

    if new_cluster:
        _handle.clear()
    if not _handle:
        _handle.append(ray.remote(num_cpus=0)(VersionClock).options(name=CLOCK, get_if_exists=True).remote())
    return _handle[0]


def live_version() -> int:
    import ray

    return int(ray.get(clock().get.remote()))


def canary_deviation() -> float | None:
    """The canary's deviation of the live version (None: not checked)."""
    return _live_with_canary()[1]


def _live_with_canary() -> tuple[int, float | None]:
    import ray

    version, deviation = ray.get(clock().get_with_canary.remote())
    return int(version), deviation


def tag_samples(original: Any) -> Any:
    """Wraps ``SamplesGenerator.generate_samples``: every returned sample gets ``rlsync_versions``. A sample whose
    rollout replayed turns recorded before a restart (``rlsync_replayed``, durable episodes) was sampled under versions
    this run does not number: its oldest is this run's first (the weights the run resumed from)."""

    @functools.wraps(original)
    def generate_samples(self: Any, **kwargs: Any) -> Any:
        oldest = live_version()
        first = getattr(self, "_rlsync_first_version", oldest)
        if self is not None:
            self._rlsync_first_version = first
        with span("request", versions=[oldest, oldest]) as timeline:  # a generation phase, as the generator saw it
            result = original(self, **kwargs)
            newest = live_version()
            timeline.update(samples=len(result[0]), versions=[oldest, newest])
        for sample in result[0]:
            sample.rlsync_versions = (min(first, oldest) if getattr(sample, "rlsync_replayed", False) else oldest, newest)
        return result

    return generate_samples


def _tokens(sample: Any) -> int:
    """The tokens a sample generated (OpenRLHF's ``Experience.action_mask``), or 1 where it does not say."""
    mask = getattr(sample, "action_mask", None)
    return int(mask.sum()) if mask is not None else 1


def gate_samples(original: Any, max_staleness: int | None) -> Any:
    """Wraps ``BasePPOTrainer.train_step``: stale samples never reach the experience maker (nor the loss)."""
    gate = MaxStaleness(max_staleness) if max_staleness is not None else None

    @functools.wraps(original)
    def train_step(self: Any, rollout_samples: Any, global_step: int) -> Any:
        live, deviation = _live_with_canary()  # one round trip to the clock
        kept, lags = [], []
        for sample in rollout_samples:
            oldest, newest = getattr(sample, "rlsync_versions", (live, live))
            stamp = Sample("", np.zeros(2, np.int64), 0, np.zeros(2, np.float32), np.array([oldest, newest]))
            if gate is None or gate(stamp, live) is Decision.TRAIN:
                kept.append(sample)
                lags.append(live - oldest)
        dropped = len(rollout_samples) - len(kept)
        timeline = recording()
        if timeline.path is not None:  # recording: the drop, and the batch the trainer takes with its staleness in tokens
            if dropped:
                timeline.event("drop", samples=dropped, version=live)
            counts = np.bincount(np.array(lags, np.int64).clip(0), weights=[_tokens(s) for s in kept]) if kept else ()
            timeline.event("batch", samples=len(kept), version=live, lags={str(k): int(n) for k, n in enumerate(counts) if n})
        extra = {"rlsync/dropped_stale": float(dropped), "rlsync/version": float(live)}
        if deviation is not None:
            extra["rlsync/canary_deviation"] = deviation
        if not kept:  # nothing fresh enough: no step, the weights stay as they are
            return {**extra, "rlsync/staleness_mean": float("nan")}, global_step
        with span("train", step=global_step, version=live):
            status, step = original(self, kept, global_step)
        status.update(extra)
        status["rlsync/staleness_mean"] = float(np.mean(lags))
        return status, step

    return train_step
