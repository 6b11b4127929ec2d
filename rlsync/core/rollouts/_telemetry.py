"""Buffer telemetry: per-token version-lag histogram, drops, aborts, admission stalls."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class BufferTelemetry:
    def __init__(self) -> None:
        self.put = 0
        self.got = 0
        self.dropped = 0
        self.aborted = 0
        self.stalls = 0
        self.stall_seconds = 0.0
        self.lag_histogram = np.zeros(8, np.int64)  # index = lag in versions; the last bin counts lag >= 7

    def stall(self, seconds: float) -> None:
        self.stalls += 1
        self.stall_seconds += seconds

    def record(self, samples: Sequence[Any], trainer_version: int) -> None:
        """Add the per-token lags of a batch. Most samples come from one version: count those
        without touching their tokens; bin the others token by token."""
        hist = self.lag_histogram
        for s in samples:
            if s.oldest_version == s.newest_version:
                hist[min(trainer_version - s.oldest_version, 7)] += len(s.versions)
            else:
                lags = np.minimum(trainer_version - s.versions, 7).astype(np.int64)
                hist += np.bincount(lags, minlength=8)[:8]

    def summary(self) -> dict[str, Any]:
        return {
            "put": self.put, "got": self.got, "dropped": self.dropped, "aborted": self.aborted,
            "admission_stalls": self.stalls, "stall_seconds": round(self.stall_seconds, 3),
            "token_lag_histogram": self.lag_histogram.tolist(),
        }

    def render(self) -> str:
        s = self.summary()
        hist = " ".join(f"{i}{'+' if i == 7 else ''}:{n}" for i, n in enumerate(s["token_lag_histogram"]) if n)
        return (f"buffer: put {s['put']} got {s['got']} dropped {s['dropped']} aborted {s['aborted']} | "
                f"admission stalls {s['admission_stalls']} ({s['stall_seconds']} s) | token lag {hist or '-'}")
