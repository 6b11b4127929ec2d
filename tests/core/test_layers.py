"""The import contracts (pyproject's ``[tool.importlinter]``) hold, and they break when a forbidden import is
added: checked on a copy of the package with one such import written into it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[2]


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})


def copy_of_the_package(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "rlsync", tree / "rlsync", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("rlsync/core/sync/_writer.py", "from rlsync.wire import Fp8Codec", "Layers"),  # core imports a higher layer
    ("rlsync/adapters/trl/_callback.py", "from rlsync.core.sync._writer import WeightsWriter", "Private modules"),
    ("rlsync/patches/openrlhf/__init__.py", "from rlsync.adapters.openrlhf import main", "Layers"),
    ("rlsync/adapters/sglang/__init__.py", "from rlsync.adapters.vllm._probe import probe", "Private modules"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, line: str, contract: str) -> None:
    tree = copy_of_the_package(tmp_path)
    assert lint(tree).returncode == 0  # the copy as it is keeps every contract
    target = tree / module
    target.write_text(target.read_text() + f"\n{line}  # injected by the test\n")
    broken = lint(tree)
    assert broken.returncode != 0, broken.stdout
    assert f"{contract}" in broken.stdout and "BROKEN" in broken.stdout
