"""Benchmarks behind ``rlsync bench``; each measures rlsync against baselines in the same run.

``run_weights``, ``run_wire``, ``run_buffer``, ``run_engine``, ``run_device``, ``run_mask``, ``run_tensors``: the seven
kinds, as the CLI calls them.
Each is imported when called: the benchmark modules also run as worker scripts (``python -m rlsync.bench._weights``),
and a package that imported them first would make runpy warn in every worker.
"""

from __future__ import annotations

from typing import Any


def parse_size(text: str) -> int:
    """Bytes of a size as rlsync's commands take it: a number and a unit, binary (``256MiB``) or decimal (``64MB``),
    at least 1 MiB; anything else is a ``ConfigError`` naming the form (``rlsync bench --size``, the examples)."""
    from rlsync.bench._weights import parse_size as parse

    return parse(text)


def run_buffer(**options: Any) -> None:
    from rlsync.bench._buffer import run

    run(**options)


def run_device(**options: Any) -> None:
    from rlsync.bench._device import run

    run(**options)


def run_engine(**options: Any) -> None:
    from rlsync.bench._engine import run

    run(**options)


def run_mask(**options: Any) -> None:
    from rlsync.bench._mask import run

    run(**options)


def run_tensors(**options: Any) -> None:
    from rlsync.bench._tensors import run

    run(**options)


def run_weights(**options: Any) -> None:
    from rlsync.bench._weights import run

    run(**options)


def run_wire(**options: Any) -> None:
    from rlsync.bench._wire import run

    run(**options)


__all__ = ["parse_size", "run_buffer", "run_device", "run_engine", "run_mask", "run_tensors", "run_weights", "run_wire"]
