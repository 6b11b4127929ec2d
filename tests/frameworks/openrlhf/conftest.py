"""Fixtures of the OpenRLHF launcher tests: a local CPU Ray started the way ``rlsync launch openrlhf`` starts it.

OpenRLHF 0.11.2 imports flash-attn at import time (a CUDA-only build): ``fakes/flash_attn`` is a FAKE of that
import surface, on ``PYTHONPATH`` for this process and every Ray worker, as are these helpers and the shared
``tests/_support`` (Ray workers import the test actors' modules by name)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent
FAKES = str(HERE / "fakes")
TESTS = str(HERE.parents[1])  # for _support
sys.path[:0] = [str(HERE), FAKES]
os.environ["PYTHONPATH"] = os.pathsep.join([FAKES, str(HERE), TESTS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)

pytest.importorskip("openrlhf")
pytest.importorskip("vllm")
pytest.importorskip("ray")


@pytest.fixture(scope="module")
def launched_ray(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """Ray as the launcher starts it: its worker hook, OpenRLHF's env vars and rlsync's options."""
    import ray

    from rlsync import __version__
    from rlsync.adapters.openrlhf._launch import start_ray
    from rlsync.patches.openrlhf import OPTIONS_ENV, installed_version

    opts: dict[str, object] = {"rlsync": __version__, "openrlhf": installed_version(), "transport": "shm",
                               "host": "127.0.0.1", "timeout": 300.0, "max_staleness": None,
                               "wire": "delta"}  # `--wire delta`: a version that changes everything goes in full
    saved = dict(os.environ)
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    start_ray(opts)
    try:
        yield opts
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)
        assert OPTIONS_ENV not in os.environ
