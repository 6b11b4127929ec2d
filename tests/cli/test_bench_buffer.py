"""``rlsync bench --buffer --json``: every backend beside its plain alternative, in one run."""

import json
import subprocess
import sys


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
