"""A staleness sampler for verl's v1 trainers, on rlsync's ``MaxStaleness`` gate.

    trainer.v1.sampler.custom_sampler.path=<this file>      # python -c "import rlsync.adapters.verl.sampler as s; print(s.__file__)"
    trainer.v1.sampler.custom_sampler.name=RlsyncStalenessSampler
    trainer.v1.sampler.max_off_policy_threshold=N           # as with verl's own sampler
    trainer.v1.sampler.max_off_policy_strategy=drop

verl's built-in async sampler drops a GRPO group by the step its prompt was *dispatched* at
(``prompt_global_steps``). A prompt can wait in the queue, or a partial rollout can resume, so that step is
not the version of the weights that produced the tokens. verl records that per trajectory
(``min_global_steps``: the weights its generation started with; ``max_global_steps``: ended with), and this
sampler gates on it: each trajectory becomes an rlsync ``Sample`` whose token versions span
``[min_global_steps, max_global_steps]``, and rlsync's ``MaxStaleness`` gate drops the whole group when any
of its trajectories is too old. The bound is verl's (``global_steps - version + 1 > max_off_policy_threshold``
with the trainer at ``global_steps - 1``), so the same setting keeps its meaning.

Importance weights are not the sampler's job: they need the trainer's log-probs, which verl computes in its
loss (``algorithm.rollout_correction``) with the behaviour log-probs it already stores; a sampler sees only tags.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from rlsync import Decision, MaxStaleness, Sample


class RlsyncStalenessSampler(ReplayBufferAsync):  # type: ignore[misc]  # verl is untyped
    """verl's async replay buffer, with stale groups chosen by the weights that generated them; see the module."""

    def _stale_terminal_keys(self, global_steps: int, partition_id: str) -> set[str]:
        if partition_id == "val" or self.max_off_policy_threshold is None or self.max_off_policy_strategy != "drop":
            return set()
        gate = MaxStaleness(int(self.max_off_policy_threshold) - 1)
        trainer_version = global_steps - 1  # the weights the trainer holds while it samples for this step
        stale = set()
        finished = self.finished_keys[partition_id]
        for key, tag in self.partitions[partition_id].items():
            uid = key.split("_")[0]
            if uid in finished and uid not in stale and gate(_as_sample(key, tag, global_steps), trainer_version) is Decision.DROP:
                stale.add(uid)
        return stale


def _as_sample(key: str, tag: dict[str, Any], global_steps: int) -> Sample:
    """One trajectory as an rlsync sample whose two generated 'tokens' carry its first and last weight versions."""
    first = tag.get("min_global_steps")
    last = tag.get("max_global_steps")
    first = global_steps - 1 if first is None else int(first)
    last = first if last is None else int(last)
    return Sample(key, np.zeros(2, np.int32), 0, np.zeros(2, np.float32), np.array([first, last], np.int64), sample_id=key)
