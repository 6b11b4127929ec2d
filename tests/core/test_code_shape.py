"""The package stays readable in one sitting per piece (issue #55): no class over 300 lines and no function over 80
in ``rlsync/``, and the core in its four rooms with the errors at the top."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[2] / "rlsync"
MAX_CLASS, MAX_FUNCTION = 300, 80


def too_long(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1 if isinstance(node, ast.stmt) else 0
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS:
                found.append(f"{path.relative_to(root.parent)}: class {node.name}, {lines} lines (at most {MAX_CLASS})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION:
                found.append(f"{path.relative_to(root.parent)}: {node.name}(), {lines} lines (at most {MAX_FUNCTION})")
    return found


def test_no_class_over_300_lines_and_no_function_over_80() -> None:
    assert too_long() == [], "split these along their seams:\n" + "\n".join(too_long())


def test_the_check_finds_a_long_function(tmp_path: Path) -> None:
    (tmp_path / "long.py").write_text("def f():\n" + "    x = 1\n" * 80 + "\n\nclass C:\n" + "    y = 1\n" * 300)
    assert too_long(tmp_path) == ["tmp_path_dir/long.py: f(), 81 lines (at most 80)".replace("tmp_path_dir", tmp_path.name),
                                  f"{tmp_path.name}/long.py: class C, 301 lines (at most 300)"]


def test_the_core_is_five_rooms_and_its_errors() -> None:
    core = PACKAGE / "core"
    rooms = sorted(p.name for p in core.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert rooms == ["hooks", "layouts", "rollouts", "sync", "timeline"]
    assert sorted(p.name for p in core.glob("*.py")) == ["__init__.py", "_errors.py"]
    for room in rooms:
        doc = ast.get_docstring(ast.parse((core / room / "__init__.py").read_text()))
        assert doc and "import" in doc, f"rlsync/core/{room}/__init__.py says what it owns and what it may import"


@pytest.mark.parametrize("name", ["rlsync", "rlsync.layouts", "rlsync.testing"])
def test_public_names_still_import(name: str) -> None:
    import importlib

    assert importlib.import_module(name).__all__
