"""Benchmarks behind ``rlsync bench``; each measures rlsync against baselines in the same run.

``run_weights``, ``run_wire``, ``run_buffer``, ``run_engine``, ``run_device``: the five kinds, as the CLI calls them.
"""

from rlsync.bench._buffer import run as run_buffer
from rlsync.bench._device import run as run_device
from rlsync.bench._engine import run as run_engine
from rlsync.bench._weights import run as run_weights
from rlsync.bench._wire import run as run_wire

__all__ = ["run_buffer", "run_device", "run_engine", "run_weights", "run_wire"]
