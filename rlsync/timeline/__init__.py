"""A run's timeline (issue #69): record it as the run goes, read back where each pool's time went, and predict what
another setting would buy.

    import rlsync
    from rlsync import timeline

    with rlsync.record_timeline("runs/t1.jsonl"):        # or RLSYNC_TIMELINE=runs/ (one file per process)
        with timeline.span("run", mode="async"):
            ...                                          # rlsync records its buffer's and writers' events itself
            with timeline.span("request", sequences=4) as r:
                r["tokens"] = ...                        # what only the caller knows: its requests, its train steps
    summaries = [timeline.summarize_run(run, events) for run, events in timeline.split_runs(timeline.read_timeline("runs/t1.jsonl"))]

``rlsync timeline RUN`` prints the same, with a Gantt chart (PNG) and a Chrome trace; ``rlsync simulate --timeline
RUN`` fits the run's costs and predicts lockstep, one-step-off, async and async with partial rollouts
(``rlsync.timeline._simulate``'s docstring says what the model holds and what it leaves out).
"""

from rlsync.core import Recorder, record_timeline, recording, span
from rlsync.timeline._pictures import chrome_trace, gantt
from rlsync.timeline._read import read_timeline, split_runs
from rlsync.timeline._shares import summarize_run
from rlsync.timeline._simulate import MODES, Costs, fit_costs, predict, simulate

__all__ = ["MODES", "Costs", "Recorder", "chrome_trace", "fit_costs", "gantt", "predict", "read_timeline",
           "record_timeline", "recording", "simulate", "span", "split_runs", "summarize_run"]
