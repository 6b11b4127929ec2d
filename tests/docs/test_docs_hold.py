"""The docs cannot drift from the code: every Python block in README.md and docs/ runs (or says, just above it, why
it cannot run here and still compiles and names only what exists), every relative link and its anchor resolves, every
``rlsync.…`` name resolves and is public, and every repository path the docs name exists. The checkers are plain
functions, and the last test shows each one catching a broken doc."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*\n```python\n", re.S)
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAME = re.compile(r"(?<![\w./-])rlsync(?:\.\w+)+")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
OWN_PATH = re.compile(r"^(?:rlsync|tests|docs|examples|scripts|\.ci)/[\w./-]*(?:\.\w+|/)$")  # a file or a folder


def blocks(text: str) -> list[tuple[str, str | None]]:
    """The Python blocks of a doc, each with the reason it is not run (``None``: it runs). Each block keeps its place:
    blank lines stand for the doc's lines above it, so a traceback names the doc's own line."""
    reasons = {m.end(): m.group(1) for m in NOT_RUN.finditer(text)}
    return [("\n" * text.count("\n", 0, m.start(1)) + m.group(1), reasons.get(m.start(1))) for m in BLOCK.finditer(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(doc: Path, text: str) -> list[str]:
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check offline
        path, _, anchor = target.partition("#")
        where = (doc.parent / path).resolve() if path else doc
        if not where.exists():
            broken.append(f"{target}: no file {where.relative_to(ROOT) if where.is_relative_to(ROOT) else where}")
        elif anchor and where.suffix == ".md":
            headings = {slug(h) for h in re.findall(r"^#+ (.+)$", where.read_text(), re.M)}
            if anchor not in headings:
                broken.append(f"{target}: no heading #{anchor} in {where.name}")
    return broken


def _defines(module_file: Path, name: str) -> bool:
    """Whether a module that cannot be imported here (its framework is not installed) defines ``name`` at top level."""
    tree = ast.parse(module_file.read_text())
    top = [n for node in tree.body for n in ([*node.body, *node.orelse] if isinstance(node, ast.Try) else [node])]
    for node in top:  # a try's branches count: a name defined where an optional import worked
        targets: list[str] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            targets = [(a.asname or a.name).split(".")[0] for a in node.names]
        if name in targets:
            return True
    return False


def _read_instead(name: str, parts: list[str]) -> str | None:
    """``unresolved`` for a module that cannot be imported here: its longest prefix that is a file, then one name."""
    for cut in range(len(parts), 1, -1):
        for module_file in (ROOT.joinpath(*parts[:cut]).with_suffix(".py"), ROOT.joinpath(*parts[:cut], "__init__.py")):
            if module_file.exists():
                rest = parts[cut:]
                if not rest or _defines(module_file, rest[0]):
                    return None
                return f"{name}: {'.'.join(parts[:cut])} has no {rest[0]}"
    return f"{name}: no module"


def unresolved(name: str) -> str | None:
    """Why ``name`` (``rlsync.a.b.C.d``) is not a public name of rlsync, or ``None`` when it is."""
    parts = name.split(".")
    if any(p.startswith("_") and not p.startswith("__") for p in parts):
        return f"{name}: a private name (the docs promise public names only)"
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("rlsync"):  # ours, but it needs a framework not installed: read it
                return _read_instead(name, parts)
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{name}: {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return None
    return f"{name}: no module"


def names_in(text: str) -> set[str]:
    """The ``rlsync.…`` names a doc mentions in code: spans, blocks, and what the blocks import."""
    code = CODE_SPAN.findall(text) + [block for block, _ in blocks(text)]
    found = {n for piece in code for n in NAME.findall(piece)}
    for block, _ in blocks(text):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "rlsync":
                found |= {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] == "rlsync" and "." in a.name}
    return found


def missing_paths(text: str) -> list[str]:
    return [p for p in CODE_SPAN.findall(text) if OWN_PATH.match(p) and not (ROOT / p).exists()]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_python_block_runs_or_says_why_not(doc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    namespace: dict[str, Any] = {"__name__": f"doc_{doc.stem}"}  # a doc's blocks build on each other, in order
    for block, reason in blocks(doc.read_text()):
        code = compile(block, str(doc.relative_to(ROOT)), "exec")
        if reason is None:
            exec(code, namespace)


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_links_names_and_paths_resolve(doc: Path) -> None:
    text = doc.read_text()
    problems = broken_links(doc, text) + [why for n in sorted(names_in(text)) if (why := unresolved(n))] + [
        f"{p}: no such file in the repository" for p in missing_paths(text)]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_doc_that_drifted() -> None:
    doc = ROOT / "docs" / "drifted.md"
    drifted = ("See [the guide](extending.md), [gone](missing.md), [no heading](reliability.md#no-such-heading).\n"
               "Use `rlsync.WeightsWriter`, `rlsync.NoSuchThing`, `rlsync.core._weights.x` and `rlsync.nomodule.f`;\n"
               "`tests/core/test_refusal.py` holds it, `tests/core/test_gone.py` not.\n"
               "<!-- not run: needs an engine -->\n```python\nfrom rlsync.adapters.trl import NoSuchCallback\n```\n")
    assert broken_links(doc, drifted) == ["missing.md: no file docs/missing.md",
                                          "reliability.md#no-such-heading: no heading #no-such-heading in reliability.md"]
    assert {n: unresolved(n) for n in sorted(names_in(drifted)) if unresolved(n)} == {
        "rlsync.NoSuchThing": "rlsync.NoSuchThing: rlsync has no NoSuchThing",
        "rlsync.adapters.trl.NoSuchCallback": "rlsync.adapters.trl.NoSuchCallback: rlsync.adapters.trl has no NoSuchCallback",
        "rlsync.core._weights.x": "rlsync.core._weights.x: a private name (the docs promise public names only)",
        "rlsync.nomodule.f": "rlsync.nomodule.f: rlsync has no nomodule"}
    assert missing_paths(drifted) == ["tests/core/test_gone.py"]
    assert blocks(drifted) == [("\n" * 5 + "from rlsync.adapters.trl import NoSuchCallback\n", "needs an engine")]


UNPLACEABLE = re.compile(r"\b(workplace|lent)\b", re.I)  # words for machines that no reader of the project can place


def unplaceable_words(text: str) -> list[str]:
    """Where a text names its machines in words a user cannot place (say the CPU model and cores, or "a GPU machine
    with no package index", instead)."""
    return [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in UNPLACEABLE.finditer(text)]


def test_no_text_file_names_its_machines_in_words_a_user_cannot_place() -> None:
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    problems = []
    for name in filter(None, (n.decode() for n in tracked)):
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files, and files deleted in the work tree
        if name != "tests/docs/test_docs_hold.py":  # this file names the words it refuses
            problems += [f"{name}: {where}" for where in unplaceable_words(text)]
    assert not problems, "\n".join(problems)
    assert unplaceable_words("run on the lent H100;\nthis Workplace sets it, but a silent one is fine") == [
        "line 1: 'lent'", "line 2: 'Workplace'"]


SERVER_START = re.compile(r"vllm serve |vllm\.entrypoints\.openai\.api_server")


def public_servers(text: str) -> list[str]:
    """The vLLM server commands of a text that do not bind loopback (a dev-mode server answers its routes to anyone who
    reaches its port, and vLLM's default host is every interface): each from where it starts to the end of its line,
    with the lines it continues on (a trailing backslash; in a program's argument list, the next four)."""
    found = []
    lines = text.split("\n")
    for number, line in enumerate(lines):
        start = SERVER_START.search(line)
        if start is None:
            continue
        command, at = line[start.start():], number
        extra = 4 if "api_server" in start.group(0) else 0
        while (command.rstrip().endswith("\\") or extra) and at + 1 < len(lines):
            at += 1
            extra = max(extra - 1, 0)
            command += "\n" + lines[at]
        if "127.0.0.1" not in command:
            found.append(command[:120])
    return found


def test_every_documented_vllm_server_command_binds_loopback() -> None:
    """Issue #66, item 6: the server command the docs, the examples and rlsync's own errors give listens on loopback."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    problems = []
    for name in filter(None, (n.decode() for n in tracked)):
        if name.startswith(("README", "docs/", "examples/", "rlsync/")) and name.endswith((".md", ".py")):
            problems += [f"{name}: {command}" for command in public_servers((ROOT / name).read_text())]
    assert not problems, "\n".join(problems)
    assert public_servers("VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{}'") != []
    assert public_servers("vllm serve MODEL \\\n    --host 127.0.0.1") == []


#: the pages a user follows (#70 item 5): each opens with what to type, and no paragraph runs over WORDS words
FOLLOWED = [ROOT / "README.md", *sorted((ROOT / "docs" / "frameworks").glob("*.md")),
            *sorted((ROOT / "docs" / "engines").glob("*.md")), ROOT / "docs" / "rollouts.md", ROOT / "docs" / "timeline.md"]
WORDS = 120


def long_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of a markdown text over WORDS words (code blocks, tables, headings and comments left out;
    a list item is a paragraph of its own)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    for block in re.split(r"\n\s*\n", prose):
        for part in re.split(r"\n(?=- )", block):
            if part.strip() and not part.lstrip().startswith(("|", "#", "<!--")) and len(part.split()) > WORDS:
                out.append(part)
    return out


@pytest.mark.parametrize("page", FOLLOWED, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_followed_page_opens_with_the_commands_and_holds_one_idea_a_paragraph(page: Path) -> None:
    text = page.read_text()
    assert "```bash" in text.split("\n## ", 1)[0], f"{page.name}: the commands come first, before the first section"
    too_long = long_paragraphs(text)
    assert not too_long, f"{page.name}: paragraphs over {WORDS} words:\n\n" + "\n\n".join(p[:200] for p in too_long)
    assert long_paragraphs(" ".join(["word"] * (WORDS + 1))) and not long_paragraphs("```\n" + "w " * 500 + "\n```")
