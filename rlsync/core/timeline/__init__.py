"""A run's timeline: what rlsync and its caller record as the run goes (``rlsync.timeline`` reads it back).

Owns the recorder and this process's current one; rollouts and sync record into it. It may import msgspec and the core's
errors, nothing else of rlsync."""

from rlsync.core.timeline._recorder import DEFAULT_MAX_BYTES, ENV, OFF, Recorder, record_from_now, record_timeline, recording, span

__all__ = ["DEFAULT_MAX_BYTES", "ENV", "OFF", "Recorder", "record_from_now", "record_timeline", "recording", "span"]
