"""``rlsync bench --wire delta --json``: full and delta versions of real AdamW steps, in one run, delta bit-exact."""

import json
import subprocess
import sys

import pytest


@pytest.mark.multiproc
@pytest.mark.parametrize("transport", [None, "shm"], ids=["tcp", "shm"])
def test_bench_wire_delta_reports_bytes_time_and_exactness(transport: str | None) -> None:
    extra = [] if transport is None else ["--transports", transport]
    out = subprocess.run(
        [sys.executable, "-m", "rlsync.cli", "bench", "--wire", "delta", "--size", "8MiB", "--steps", "4", "--json", *extra],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["memcpy_gbps"] > 0 and report["lr"] == 1e-6 and report["transport"] == (transport or "tcp")
    steps = report["steps"]
    assert [s["version"] for s in steps] == [1, 2, 3, 4]
    assert all(s["full"]["bit_exact"] and s["delta"]["bit_exact"] for s in steps)
    assert all(s["full"]["bytes"] == report["model_bytes"] for s in steps)
    assert steps[0]["changed_fraction"] == 0 and all(0 < s["changed_fraction"] < 0.1 for s in steps[1:])
    assert all(s["delta"]["encode_seconds"] > 0 and s["delta"]["apply_seconds"] > 0 for s in steps[1:])
    assert report["summary"]["delta_bit_exact"]
    if transport is None:  # tcp, a slow link's transport: compressed, a few percent of the bytes
        assert all(0 < s["delta"]["bytes"] < 0.05 * report["model_bytes"] for s in steps[1:])
        assert report["summary"]["bytes_ratio"] < 0.05
        return
    # over shm (a memory-speed link) not compressed: 4 bytes of gap and 2 of value per changed bf16 value, 3x the
    # changed share of the bytes, plus the headers
    for s in steps[1:]:
        planes = 3 * s["changed_fraction"] * report["model_bytes"]
        assert planes <= s["delta"]["bytes"] < planes + 100_000, s


def test_bench_wire_other_than_delta_is_refused() -> None:
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--wire", "fp8"], capture_output=True, text=True)
    assert out.returncode == 2 and "rlsync plan --wire fp8" in out.stderr


@pytest.mark.multiproc
def test_over_a_slow_link_the_bytes_that_cross_it_are_the_deltas() -> None:
    """``--link-gbps``: the readers in another network namespace behind a rate-limited veth; what each version put on
    the link (its tx_bytes) is what the writer sent plus TCP/IP's and the control messages' overhead."""
    from rlsync.bench._link import unavailable

    why = unavailable()
    if why is not None:
        pytest.skip(why)
    out = subprocess.run(
        [sys.executable, "-m", "rlsync.cli", "bench", "--wire", "delta", "--size", "8MiB", "--steps", "3",
         "--link-gbps", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["link_gbps"] == 1 and report["transport"] == "tcp"
    for step in report["steps"]:
        for kind in ("full", "delta"):
            sent, crossed = step[kind]["bytes"], step[kind]["link_bytes"]
            assert step[kind]["bit_exact"] and sent <= crossed < sent * 1.1 + 200_000, (kind, sent, crossed)
    # 8 MiB at 1 Gbit/s takes at least 67 ms in full; the link, not memory, is the limit
    assert all(s["full"]["seconds"] > 0.8 * report["model_bytes"] * 8 / 1e9 for s in report["steps"][1:])
    assert report["summary"]["delta_link_bytes_median"] < 0.05 * report["summary"]["full_link_bytes_median"]


def test_a_wire_bench_larger_than_memory_is_refused_before_it_starts() -> None:
    """At 1 GiB with a relay host of 4 ranks the run needs about 30 GB; on a 24 GB machine the kernel killed it and
    nothing was printed. Now the bench says what it needs and what to change, before a process starts."""
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--wire", "delta", "--size", "4TiB", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and not out.stdout
    assert "needs about" in out.stderr and "GB of memory" in out.stderr and "a smaller --size" in out.stderr
    assert "--fanout-ranks" not in out.stderr  # no relay host without --link-gbps: not a fix to offer


def test_the_shared_memory_a_killed_run_left_is_freed_before_memory_is_counted() -> None:
    """A run the kernel killed leaves its readers' landings in /dev/shm (8 GB after a relay host at 1 GiB), counted
    as taken by the next run's memory check: the bench frees a dead process's ``rlsync-<pid>-*`` files first."""
    import os

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = f"/dev/shm/rlsync-{gone.pid}-slot0"
    with open(left, "wb") as f:
        f.write(b"\0" * 4096)
    try:
        out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--wire", "delta", "--size", "4TiB", "--json"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "needs about" in out.stderr
        assert not os.path.exists(left)
    finally:
        if os.path.exists(left):
            os.unlink(left)


def test_fanout_ranks_without_a_link_is_a_usage_error() -> None:
    out = subprocess.run([sys.executable, "-m", "rlsync.cli", "bench", "--wire", "delta", "--fanout-ranks", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--link-gbps" in out.stderr and not out.stdout
