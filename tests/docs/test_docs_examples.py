"""The code in the README and in docs/extending.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import rlsync

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def test_the_extending_guides_transport_passes_the_conformance_checks() -> None:
    blocks = python_blocks(ROOT / "docs" / "extending.md")
    assert len(blocks) == 3
    transport_code = blocks[0]
    assert 30 <= len(transport_code.strip().splitlines()) <= 60  # "a new transport in about 40 lines"
    namespace: dict[str, Any] = {"__name__": "extending_md"}
    for block in blocks:  # the transport, its conformance check (raises if broken), the plugin hook
        exec(compile(block, "docs/extending.md", "exec"), namespace)
    pm = rlsync.make_plugin_manager(autoload=False)
    plugin = type("FilePlugin", (), {"rlsync_register_transports": staticmethod(namespace["rlsync_register_transports"])})
    pm.register(plugin, name="file-plugin")
    assert rlsync.core.transports(pm).get("file") is namespace["FileTransport"]


def test_the_readme_examples_run() -> None:
    weights, rollouts = python_blocks(ROOT / "README.md")
    assert "WeightsWriter" in weights and len(weights.strip().splitlines()) <= 25  # "in 20 lines", give or take
    for example in (weights, rollouts):
        namespace: dict[str, Any] = {"__name__": "readme"}
        exec(compile(example, "README.md", "exec"), namespace)
    assert namespace["batch"].trainer_version == 0 and len(namespace["weights"]) == 2
