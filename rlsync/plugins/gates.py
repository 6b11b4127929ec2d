"""The built-in staleness gate: ``MaxStaleness`` with the buffer's own ``max_staleness``, asked last."""

from __future__ import annotations

from rlsync import Decision, MaxStaleness, Sample, hookimpl


@hookimpl(trylast=True)
def rlsync_gate_sample(sample: Sample, trainer_version: int, max_staleness: int) -> Decision | None:
    return Decision.DROP if MaxStaleness(max_staleness)(sample, trainer_version) is Decision.DROP else None
