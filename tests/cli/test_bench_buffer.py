"""``rlsync bench --buffer --json``: every backend beside its plain alternative, in one run."""

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from rlsync.bench._buffer import backends


def test_bench_buffer_json_shape() -> None:
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--buffer", "--repeats", "1", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)["results"]
    names = [r["name"] for r in results]
    assert names[:4] == ["memory", "memory-baseline", "memory+routes", "memory+routes-baseline"]  # routes: MoE per token
    for r in results:
        assert r["kind"] == ("baseline" if r["name"].endswith("-baseline") else "backend")
        assert r["samples_per_s"] > 0
        if r["kind"] == "backend":
            assert f"{r['name']}-baseline" in names
    assert json.loads(out.stdout)["skipped"] == []  # this session installs Ray, redis-py and redis-server
    episodes = json.loads(out.stdout)["episodes"]  # recording a turn and resuming an episode, per backend
    assert [e["name"] for e in episodes] == ["memory", "ray", "redis"]
    assert all(e["turn_s"] > 0 and e["plain_turn_s"] > 0 and e["resume_s"] > 0 for e in episodes)


def test_a_backend_that_cannot_run_here_is_named_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("ray", "redis") else real(name, *a))
    runs, skipped = backends()
    assert [name for name, _ in runs] == ["memory", "memory+routes"]
    assert skipped == [{"name": "ray", "why": "Ray is not installed (pip install 'rlsync[ray]' to measure it)"},
                       {"name": "redis", "why": "redis-py is not installed (pip install 'rlsync[redis]' to measure it)"}]
    monkeypatch.setattr(importlib.util, "find_spec", real)
    monkeypatch.setattr(shutil, "which", lambda program: None)
    assert backends()[1][-1] == {"name": "redis", "why": "no redis-server on PATH (e.g. apt install redis-server)"}
