"""A newcomer's first commands on the plain install (``pip install torch==2.13.0 -e .``, no extra): run by the nox
session ``plain``, whose environment has nothing else but pytest. Every command with no extra does something useful
and says what it skipped; every example that needs nothing more runs; the ones that need an extra stop with one line
naming it, before they write anything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = ("transformers", "vllm", "trl", "verl", "openrlhf", "ray", "redis", "nixl")


def run(*args: str, cwd: Path | None = None, timeout: float = 600,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def test_this_is_the_plain_install() -> None:
    assert [m for m in EXTRAS if importlib.util.find_spec(m) is not None] == []  # else the tests below prove nothing


def test_bench_with_no_transport_named_measures_what_runs_and_names_what_it_skipped() -> None:
    out = run("-m", "rlsync.cli", "bench", "--size", "32MiB", "--repeats", "1")  # `rlsync bench` at a CI-sized model
    assert out.returncode == 0, out.stderr
    assert "skipped nixl: not installed here (pip install 'rlsync[nixl]' to measure it)" in out.stderr
    assert all(f"│ {path}" in out.stdout for path in ("shm ", "tcp ", "torchdist ", "gloo-"))
    assert "Warning" not in out.stderr


def test_bench_buffer_runs_the_embedded_buffer_and_names_the_backends_it_skipped() -> None:
    out = run("-m", "rlsync.cli", "bench", "--buffer", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    assert "skipped ray: Ray is not installed (pip install 'rlsync[ray]' to measure it)" in out.stderr
    assert "skipped redis: redis-py is not installed" in out.stderr and "│ memory" in out.stdout


@pytest.mark.parametrize("command", [["plan"], ["doctor"], ["launch", "openrlhf", "--help"]])
def test_the_other_commands_run(command: list[str]) -> None:
    out = run("-m", "rlsync.cli", *command)
    assert out.returncode == 0, out.stderr


def test_the_weight_sync_example_runs_and_the_engine_computes_what_the_trainer_does(tmp_path: Path) -> None:
    # 32MB: the size parser of rlsync bench (decimal units too; #70 item 4 found the example refusing what it took)
    out = run(str(ROOT / "examples" / "sync_weights.py"), "--size", "32MB", "--versions", "2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("sync_weights: building"), out.stdout[:200]  # said before the silent seconds (#70 item 3)
    lines = [line for line in out.stdout.splitlines() if line.startswith("version ")]
    assert len(lines) == 2 and all("the engine's output equals the trainer's" in line for line in lines)


def test_the_rollout_buffer_example_runs_within_its_staleness_bound(tmp_path: Path) -> None:
    out = run(str(ROOT / "examples" / "rollout_buffer.py"), "--steps", "6", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert len([line for line in out.stdout.splitlines() if line.startswith("step ")]) == 6
    assert "token lag 0:" in out.stdout


@pytest.mark.parametrize(("example", "args", "says"), [
    ("async_rl.py", ["--out", "out"], "async_rl.py needs vllm, transformers, tokenizers, matplotlib: pip install -e '.[trl,vllm]'"),
    ("trl_grpo.py", ["--out", "out"], "trl_grpo.py needs trl, vllm, transformers, tokenizers, datasets, matplotlib"),
    ("sync_weights.py", ["--model", "qwen2"], "--model qwen2 needs transformers: pip install 'rlsync[hf]'"),
    ("rollout_buffer.py", ["--backend", "redis"], "--backend redis needs redis: pip install 'rlsync[redis]'"),
    ("megatron_sync.py", [], "megatron_sync.py needs megatron, vllm, transformers: pip install -e '.[megatron,vllm]'"),
])
def test_an_example_that_needs_an_extra_says_which_before_it_writes_anything(example: str, args: list[str], says: str,
                                                                              tmp_path: Path) -> None:
    out = run(str(ROOT / "examples" / example), *args, cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith(says), out.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_backend_or_adapter_whose_extra_is_missing_names_the_extra_within_a_second() -> None:
    """#58: make_buffer("redis") without redis-py and `import rlsync.adapters.trl` without TRL were bare
    ModuleNotFoundErrors; now each says which extra installs what it needs."""
    import time

    from rlsync import ConfigError, make_buffer  # loads torch: seconds, before the clock starts

    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"pip install 'rlsync\[redis\]'"):
        make_buffer("redis", batch_size=2)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'rlsync\[trl\]'"):
        import rlsync.adapters.trl  # noqa: F401
    assert time.monotonic() - started < 1.0


def test_doctor_says_which_backends_need_a_package_and_names_the_gate() -> None:
    """#70 item 4: the plain install listed ray and redis as backends with no word that their packages are missing,
    and the staleness gate as a module name (rlsync.plugins.gates)."""
    out = run("-m", "rlsync.cli", "doctor", env={"COLUMNS": "250"})
    assert out.returncode == 0, out.stderr
    assert "ray (needs pip install 'rlsync[ray]')" in out.stdout and "redis (needs pip install 'rlsync[redis]')" in out.stdout
    assert "MaxStaleness (rlsync's: max_staleness)" in out.stdout and "rlsync.plugins.gates" not in out.stdout
