"""Helpers for the multi-process weight-sync tests: start writer/reader processes, check bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _support import sync_processes as procs

SCRIPT = Path(procs.__file__)  # also run as the writer's and the readers' processes


class Sync:
    layouts = staticmethod(procs.layouts)
    boxes_tp2 = procs.BOXES_TP2
    values = staticmethod(procs.values)
    delta_values = staticmethod(procs.delta_values)

    def __init__(self) -> None:
        self.children: list[subprocess.Popen[str]] = []

    def writer(self, layout: str, transport: str, readers: dict[int, str], versions: list[int], *,
               rank: int = 0, wait: bool = True, extra: tuple[str, ...] = ()) -> subprocess.Popen[str]:
        cmd = [sys.executable, str(SCRIPT), "writer", "--layout", layout, "--transport", transport, "--rank", str(rank),
               "--readers", json.dumps(readers), "--versions", *map(str, versions), *extra]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.children.append(child)
        if wait:
            out, err = child.communicate(timeout=120)
            child.stdout_text, child.stderr_text = out, err  # type: ignore[attr-defined]
        return child

    def reader(self, layout: str, transport: str, rank: int, timeout: float = 30) -> tuple[subprocess.Popen[str], str]:
        cmd = [sys.executable, str(SCRIPT), "reader", "--layout", layout, "--transport", transport,
               "--rank", str(rank), "--timeout", str(timeout)]
        child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.children.append(child)
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, child.stderr.read() if child.stderr else "reader died"
        return child, json.loads(line)["address"]

    def assert_landed(self, layout: str, reader: Any, version: int, delta: bool = False) -> None:
        """Every shard of the reader's rank holds exactly the global values of ``version``."""
        from rlsync.layouts import gather_shards

        _, dst = procs.layouts(layout)
        expected = (procs.delta_values if delta else procs.values)(dst, version)
        with reader.lock:
            for shard, view in gather_shards(dst, reader.rank, reader.buffers()):
                region = tuple(slice(o, o + n) for o, n in zip(shard.box.offsets, shard.box.sizes))
                np.testing.assert_array_equal(view, expected[shard.tensor][region], err_msg=f"{shard.tensor} v{version}")


@pytest.fixture
def sync() -> Iterator[Sync]:
    helper = Sync()
    yield helper
    for child in helper.children:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=10)


def transport_names() -> list[Any]:
    """Every registered transport, skipped where it cannot run (the conformance suite runs them all)."""
    from rlsync.core import transports

    registry = transports()
    params = []
    for name in registry.names():
        cls = registry.get(name)
        marks = [] if cls.available() else [pytest.mark.skip(reason=f"transport {name} is not available here")]
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes a ``transport`` argument runs once per registered transport."""
    if "transport" in metafunc.fixturenames:
        metafunc.parametrize("transport", transport_names())
