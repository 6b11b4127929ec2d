"""``rlsync doctor`` runs with whatever is installed and reports it."""

import pytest
from typer.testing import CliRunner

from rlsync.cli import app


def test_doctor_lists_machine_plugins_and_optional_packages() -> None:
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for heading in ("machine", "registered plugins", "optional packages", "cores", "nixl", "vllm"):
        assert heading in result.output


def test_doctor_prints_install_commands_with_their_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("verl") is not None:
        import pytest

        pytest.skip("verl is installed here: no install hint to check")
    result = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "200"})
    assert "pip install 'rlsync[verl]'" in result.output  # not swallowed as a rich style tag


def test_doctor_names_the_trl_versions_the_adapter_supports() -> None:
    from rlsync._doctor import trl_support

    assert trl_support("1.16.0") == "TRL 1.16.0: supported (RlsyncWeightTransfer, RlsyncSyncCallback)"
    verdict = trl_support("1.17.2")
    assert verdict is not None and verdict.startswith("NOT supported") and "this is TRL 1.17.2" in verdict


def test_launch_passes_everything_after_the_framework_to_its_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlsync.adapters.openrlhf as openrlhf_adapter
    from rlsync import ConfigError
    from rlsync.cli import main

    seen: list[list[str]] = []
    monkeypatch.setattr(openrlhf_adapter, "main", lambda argv: seen.append(list(argv)))
    argv = ["--max-staleness", "2", "--", "--pretrain", "m", "--vllm.num_engines", "1"]
    monkeypatch.setattr("sys.argv", ["rlsync", "launch", "openrlhf", *argv])
    main()
    assert seen == [argv]  # OpenRLHF's arguments untouched, the `--` kept
    unknown = CliRunner().invoke(app, ["launch", "verl"], env={"COLUMNS": "300"})
    assert unknown.exit_code != 0 and "no launcher for 'verl'" in unknown.output
    monkeypatch.undo()
    from rlsync.adapters.openrlhf._launch import split

    with pytest.raises(ConfigError, match="after `--`"):
        split(["--max-staleness", "2"])


def test_doctor_marks_a_transport_that_cannot_run_here_and_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlsync.plugins._transport_cuda_ipc import CudaIpcLanding

    monkeypatch.setattr(CudaIpcLanding, "available", classmethod(lambda cls: False))  # what a machine without CUDA says
    result = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "300"})
    assert "cuda_ipc (cannot run here: no CUDA GPU)" in result.output
    assert "shm (cannot run here" not in result.output


def test_launch_openrlhf_help_shows_the_launchers_own_flags() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "rlsync.cli", "launch", "openrlhf", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--max-staleness" in done.stdout and "--lora-sync" in done.stdout and "after `--`" in done.stdout


def test_doctor_says_when_dev_shm_is_a_containers_small_default() -> None:
    """Docker gives a container 64 MB of /dev/shm, where every shm reader refuses: the doctor names the fix. Here
    /dev/shm is a 64 MiB tmpfs in a mount namespace of the child's own."""
    import os
    import shlex
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a tmpfs of its own needs root and util-linux's unshare")
    doctor = f"{shlex.quote(sys.executable)} -m rlsync.cli doctor"
    script = f"mount -t tmpfs -o size=64M tmpfs /dev/shm && COLUMNS=400 {doctor}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: an installed engine cannot import (not this test's)
    assert "of 64 MiB: too small for the shm transport" in done.stdout and "--shm-size" in done.stdout, done.stdout
    roomy = subprocess.run(["sh", "-c", f"COLUMNS=400 {doctor}"], capture_output=True, text=True, timeout=120)
    assert "--shm-size" not in roomy.stdout or shutil.disk_usage("/dev/shm").total < 2**30


def test_the_printed_install_hint_is_the_exact_command(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """rich took "[nixl]" in "pip install 'rlsync[nixl]'" for a style tag and printed "pip install 'rlsync'": the
    printed text is what a user copies."""
    from rlsync import TransportError, _doctor

    real = _doctor.resolve_transport

    def without_nixl(name: str, pm: object = None) -> object:
        if name == "nixl":
            raise TransportError("not here")
        return real(name, pm)  # type: ignore[arg-type]

    monkeypatch.setattr(_doctor, "resolve_transport", without_nixl)
    monkeypatch.setenv("COLUMNS", "300")
    _doctor.run()
    printed = capsys.readouterr().out
    assert "pip install 'rlsync[nixl]'" in printed, printed
