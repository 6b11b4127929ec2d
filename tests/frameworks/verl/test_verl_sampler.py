"""rlsync's staleness sampler as verl's custom sampler: verl's own ``ReplayBufferAsync`` with groups dropped by the
weights that generated them (per-trajectory ``min_global_steps``), not by the step their prompt was dispatched."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("verl")

pytestmark = pytest.mark.filterwarnings("ignore")


def buffers() -> tuple[Any, Any]:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync  # warns on import: inside the test's filter
    from verl.utils.import_utils import load_extern_type

    import rlsync.adapters.verl.sampler as module

    # loaded the way verl's trainer loads trainer.v1.sampler.custom_sampler.{path,name}
    cls = load_extern_type(module.__file__, "RlsyncStalenessSampler")
    args = dict(trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                max_off_policy_strategy="drop", sampler_kwargs={})
    return cls(**args), ReplayBufferAsync(**args)


def fill(buffer: Any, groups: dict[str, tuple[int, list[tuple[int, int]]]]) -> None:
    """``{uid: (step its prompt was dispatched at, [(min_global_steps, max_global_steps) per trajectory])}``."""
    for uid, (dispatched, spans) in groups.items():
        buffer.finished_keys["train"].add(uid)
        buffer.prompt_global_steps["train"][uid] = dispatched
        for i, (first, last) in enumerate(spans):
            buffer.partitions["train"][f"{uid}_{i}_0"] = {"min_global_steps": first, "max_global_steps": last}


def test_groups_are_dropped_by_the_weights_that_generated_them() -> None:
    ours, verls = buffers()
    groups = {
        "fresh": (5, [(5, 5), (5, 5)]),
        "queued": (3, [(5, 5), (5, 5)]),  # dispatched long ago, but generated with the current weights
        "resumed": (5, [(5, 5), (3, 5)]),  # one trajectory started on old weights (a partial rollout)
        "old": (3, [(3, 4), (3, 3)]),
    }
    for buffer in (ours, verls):
        fill(buffer, groups)
    # at step 6 the trainer holds version 5; threshold 2 allows trajectories started on version 4 or 5
    assert ours._stale_terminal_keys(6, "train") == {"resumed", "old"}
    assert verls._stale_terminal_keys(6, "train") == {"queued", "old"}  # verl's own: by dispatch step
    assert ours._stale_terminal_keys(6, "val") == set()
