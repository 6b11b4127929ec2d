"""The public surface: ``__all__`` is sorted, complete, and importing rlsync has no side effects."""

import subprocess
import sys

import rlsync
import rlsync.testing


def test_all_is_sorted_and_importable() -> None:
    assert rlsync.__all__ == sorted(rlsync.__all__)
    for name in rlsync.__all__:
        assert getattr(rlsync, name) is not None, name


def test_every_public_name_is_exported() -> None:
    public = {n for n in vars(rlsync) if not n.startswith("_")} - {"core", "plugins", "adapters", "patches", "cli", "bench", "layouts", "wire", "testing", "timeline"}
    assert public <= set(rlsync.__all__), public - set(rlsync.__all__)


def test_import_loads_no_plugin_or_framework() -> None:
    code = (
        "import sys, rlsync; "
        "bad = [m for m in ('torch', 'vllm', 'verl', 'trl', 'openrlhf', 'ray', 'redis', 'nixl', 'rlsync.plugins.transports') "
        "if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_commands_help_and_version_import_no_torch() -> None:
    """`rlsync --help` and `--version` answer in a fraction of a second: torch (seconds to import) loads only when a
    command or a name needs it."""
    code = ("import sys; sys.argv = ['rlsync', {}]; import rlsync.cli\n"
            "try:\n    rlsync.cli.main()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    for flag in ("--help", "--version"):
        out = subprocess.run([sys.executable, "-c", code.format(repr(flag))], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert ("Usage" if flag == "--help" else "rlsync 0.") in out.stdout


def test_the_extension_contracts_are_public() -> None:
    """What a plugin author subclasses or implements: a transport, a buffer storage, a gate, a wire codec, the
    options object, the engine-neutral staged receiver, and the hooks."""
    contracts = ["Transport", "Landing", "Link", "Run", "Region", "Storage", "Gate", "WireCodec", "SyncOptions",
                 "StagedReceiver", "hookimpl", "hookspec", "plugin_manager"]
    assert set(contracts) <= set(rlsync.__all__)
    assert issubclass(rlsync.testing.MemoryTransport, rlsync.Transport)
    assert isinstance(rlsync.MemoryStorage(), rlsync.Storage)
    assert isinstance(rlsync.MaxStaleness(1), rlsync.Gate)
    import torch

    from rlsync.layouts import from_state_dict
    from rlsync.wire import Fp8Codec

    assert isinstance(Fp8Codec(from_state_dict({"x.weight": torch.zeros(128, 128)}), 0), rlsync.WireCodec)
    for name in ("Transport", "Landing", "Link", "Storage", "Gate", "WireCodec", "SyncOptions", "StagedReceiver"):
        assert "Called on:" in (getattr(rlsync, name).__doc__ or ""), f"rlsync.{name}'s docstring must say which process calls it"


def test_the_old_builtin_shadowing_name_is_gone() -> None:
    assert not hasattr(rlsync, "BufferError")  # it shadowed the builtin: rlsync.RolloutBufferError
