"""The public surface: ``__all__`` is sorted, complete, and importing rlsync has no side effects."""

import subprocess
import sys

import rlsync


def test_all_is_sorted_and_importable() -> None:
    assert rlsync.__all__ == sorted(rlsync.__all__)
    for name in rlsync.__all__:
        assert getattr(rlsync, name) is not None, name


def test_every_public_name_is_exported() -> None:
    public = {n for n in vars(rlsync) if not n.startswith("_")} - {"core", "plugins", "adapters", "patches", "cli", "bench", "layouts", "wire"}
    assert public <= set(rlsync.__all__), public - set(rlsync.__all__)


def test_import_loads_no_plugin_or_framework() -> None:
    code = (
        "import sys, rlsync; "
        "bad = [m for m in ('vllm', 'verl', 'trl', 'openrlhf', 'ray', 'redis', 'nixl', 'rlsync.plugins.transports') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
