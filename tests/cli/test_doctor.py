"""``rlsync doctor`` runs with whatever is installed and reports it."""

from typer.testing import CliRunner

from rlsync.cli import app


def test_doctor_lists_machine_plugins_and_optional_packages() -> None:
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    for heading in ("machine", "registered plugins", "optional packages", "cores", "nixl", "vllm"):
        assert heading in result.output
