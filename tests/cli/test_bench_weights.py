"""``rlsync bench --json`` runs every path in one go and reports the agreed shape."""

import json
import subprocess
import sys

import pytest

from rlsync import ConfigError
from rlsync.bench._weights import DEFAULT_TRANSPORTS, bench_spec, choose_transports, parse_size
from rlsync.core import transports
from rlsync.layouts import model_spec


def test_sizes_parse_and_the_model_comes_close() -> None:
    assert parse_size("1GiB") == 2**30 and parse_size("256MiB") == 256 * 2**20 and parse_size("10MB") == 10**7
    with pytest.raises(ValueError, match="use a number with a unit"):
        parse_size("lots")
    with pytest.raises(ValueError, match="use a number with a unit"):
        parse_size("1.2.3GiB")  # was a float() crash
    for size in (8 * 2**20, 2**30):
        got = model_spec(bench_spec(size)).nbytes
        assert 0.8 * size < got < 1.2 * size


def test_by_default_the_bench_measures_what_runs_here_and_names_what_it_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    assert choose_transports(None) == ([t for t in DEFAULT_TRANSPORTS if transports().get(t).available()],  # type: ignore[attr-defined]
                                       [{"name": t, "why": f"not installed here (pip install 'rlsync[{t}]' to measure it)"}
                                        for t in DEFAULT_TRANSPORTS if not transports().get(t).available()])  # type: ignore[attr-defined]
    monkeypatch.setattr(transports().get("nixl"), "available", classmethod(lambda cls: False))  # a plain install
    names, skipped = choose_transports(None)
    assert names == ["shm", "tcp", "torchdist"]
    assert skipped == [{"name": "nixl", "why": "not installed here (pip install 'rlsync[nixl]' to measure it)"}]
    with pytest.raises(ConfigError, match=r"'nixl' cannot run here .*pip install 'rlsync\[nixl\]'"):
        choose_transports("shm,nixl")  # asked for by name: an error, not a quiet skip
    with pytest.raises(ConfigError, match="no transport 'shmm'; registered: .*shm"):
        choose_transports("shmm")


@pytest.mark.multiproc
def test_bench_json_shape() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlsync.cli", "bench", "--size", "8MiB", "--repeats", "1", "--transports", "shm,tcp", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "Warning" not in out.stderr  # the workers run as `-m rlsync.bench._weights`: no runpy warning in each
    progress = [line for line in out.stderr.splitlines() if line.startswith("weight sync: ")]  # not a terminal: lines
    assert len(progress) == (2 + 2 + 3) * 2 and progress[-1].startswith("weight sync: shm to 4 readers (14/14, ")
    assert "s left)" in progress[0]  # with an ETA
    report = json.loads(out.stdout)
    assert report["memcpy_gbps"] > 0 and report["bytes"] > 0 and report["skipped"] == []
    assert [(r["name"], r["kind"]) for r in report["results"]] == [
        ("shm", "transport"), ("tcp", "transport"),
        ("gloo-broadcast-256MiB", "baseline"), ("safetensors-devshm", "baseline"),
    ]
    for r in report["results"]:
        assert r["seconds"] > 0 and abs(r["gbps"] - report["bytes"] / r["seconds"] / 1e9) < 1e-6
    assert [(f["readers"], f["transport"]) for f in report["fanout"]] == [(1, "shm"), (2, "shm"), (4, "shm")]
    assert report["fanout"][0]["x_one_reader"] == 1.0
    assert all(f["seconds"] > 0 and f["one_after_another_seconds"] == f["readers"] * report["fanout"][0]["seconds"]
               for f in report["fanout"])


def test_repeats_below_one_is_a_usage_error_at_once() -> None:
    """#58: --repeats -2 printed nothing for 200 s, --repeats 0 ended in StatisticsError."""
    import subprocess
    import sys

    for repeats in ("-2", "0"):
        out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--repeats", repeats], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and "--repeats" in out.stderr, out.stderr


def test_version() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "rlsync 0.1.0", out


def test_the_default_run_says_what_it_costs_and_shrinks_where_it_would_not_fit(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """#58: `rlsync bench` took 4.5 min and 9.7 GB with no word before it started."""
    from rlsync.bench import _weights

    monkeypatch.setattr(_weights, "available_bytes", lambda: 64 * 2**30)
    assert _weights.sized_run(None, 3, ["shm", "tcp"]) == 2**30
    said = capsys.readouterr().err
    assert "1,024 MiB of bf16 weights through shm, tcp (3 timed runs each)" in said and "10.2 GB of memory" in said
    assert "4-9 min" in said and "--size 256MiB" in said
    monkeypatch.setattr(_weights, "available_bytes", lambda: 4 * 10**9)  # a small machine: the default shrinks
    assert _weights.sized_run(None, 3, ["shm"]) == 256 * 2**20
    assert "1GiB would need about 10.2 GB of memory, 4.0 GB is available: measuring 256 MiB" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--size 1GiB: needs about 10.2 GB of memory .* 4.0 GB available: use a smaller"):
        _weights.sized_run("1GiB", 3, ["shm"])  # asked for: refused, not shrunk


def test_a_small_run_is_not_told_to_shrink_and_its_estimate_counts_the_fixed_start(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """#70 item 3: `rlsync bench --size 64MiB` suggested "--size 256MiB for a quicker run" and estimated 17-34 s for a
    run of 107 s (processes, imports and baselines cost about 90 s whatever the size)."""
    from rlsync.bench import _weights, parse_size

    monkeypatch.setattr(_weights, "available_bytes", lambda: 64 * 2**30)
    assert _weights.sized_run("64MiB", 3, ["shm"]) == 64 * 2**20
    said = capsys.readouterr().err
    assert "101-202 s" in said and "quicker" not in said
    assert parse_size("64MB") == 64 * 10**6 and parse_size("1GiB") == 2**30  # one parser: the examples' too
    with pytest.raises(ConfigError, match="e.g. 1GiB, 256MiB"):
        parse_size("64 megs")
