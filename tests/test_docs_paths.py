"""The project's documents speak of the project alone.

Every tracked Markdown file and every Python docstring is read for what only made sense on one
particular machine or team: absolute paths of a machine's scratch, home or install directories, the
lock wrapper of a shared machine, and words naming the people or sessions that wrote it. Commands use
placeholders (``CKPT``, ``DIR``) instead. A failure lists ``file:line: text`` for each hit.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: (readable id, pattern). Paths are matched only where they start a path (not inside a URL or
#: after ``~``), so ``~/.cache/sparse-attn`` (the product's documented default) stays allowed.
FORBIDDEN = [
    ("machine path", re.compile(r"(?<![\w.~/-])/(?:work|tmp|root|home|opt)/")),
    ("shared-machine lock", re.compile(r"\bcoord/|\bheavy2?\.lock\b|--exclusive\b|\bexclusive lock\b|\bthe shared machine\b")),
    ("teammate", re.compile(r"\bthe lead\b(?!-)|\blead's\b|\banother engineer\b|\bengineers?'s?\b|\bcoordinator\b|"
                            r"\bthe board\b|\bother sessions\b|\bthis session's\b|\bhelper session", re.I)),
]


def _tracked(pattern: str) -> list[Path]:
    """Tracked files matching a git pathspec; every such file under ROOT outside a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--", pattern], capture_output=True,
                             check=True, timeout=60).stdout.decode()
        return [ROOT / name for name in out.split("\0") if name and (ROOT / name).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".tox", ".venv", "build", "dist"}
        return [p for p in ROOT.rglob(pattern) if not skip & set(p.relative_to(ROOT).parts) and "egg-info" not in str(p)]


def _docstrings(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of the module's, each class's and each function's docstring."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                out.append((first.lineno, first.value.value))
    return out


def _texts() -> list[tuple[Path, int, str]]:
    """(file, first line, text) of every document to check: whole Markdown files, Python docstrings."""
    texts = [(p, 1, p.read_text(encoding="utf-8", errors="replace")) for p in _tracked("*.md")]
    for p in _tracked("*.py"):
        texts += [(p, line, doc) for line, doc in _docstrings(p)]
    return texts


def hits(texts: list[tuple[Path, int, str]]) -> dict[str, list[str]]:
    """Per forbidden kind, ``file:line: text`` of each hit."""
    found: dict[str, list[str]] = {kind: [] for kind, _ in FORBIDDEN}
    for path, first, text in texts:
        for offset, line in enumerate(text.splitlines()):
            for kind, pattern in FORBIDDEN:
                if pattern.search(line):
                    found[kind].append(f"{path.relative_to(ROOT)}:{first + offset}: {line.strip()[:160]}")
    return found


@pytest.fixture(scope="module")
def found() -> dict[str, list[str]]:
    texts = _texts()
    assert any(p.name == "README.md" for p, _, _ in texts) and any(p.suffix == ".py" for p, _, _ in texts), \
        "no README.md or docstring was read: the check below would prove nothing"
    return hits(texts)


@pytest.mark.parametrize("kind", [kind for kind, _ in FORBIDDEN])
def test_no_document_names_a_machine_or_a_teammate(found, kind):
    assert not found[kind], (f"{len(found[kind])} {kind} reference(s); use a placeholder (CKPT, DIR) or say it "
                             "without the machine or the people:\n" + "\n".join(found[kind]))


@pytest.mark.parametrize("text, kind", [
    pytest.param("--workdir /tmp/lead/s8k", "machine path", id="tmp-path"),
    pytest.param("(`/work/coord/heavy tools/add-release`)", "shared-machine lock", id="lock-wrapper"),
    pytest.param("Two runs by the lead on 2026-12-02", "teammate", id="the-lead"),
    pytest.param("another engineer's unit suite", "teammate", id="engineer"),
])
def test_the_check_sees_each_kind(text, kind):
    (hit,) = hits([(ROOT / "x.md", 1, f"intro\n{text}\n")])[kind]
    assert hit.startswith("x.md:2: ")


@pytest.mark.parametrize("text", [
    pytest.param("default `~/.cache/sparse-attn`", id="product-default"),
    pytest.param("see https://example.org/home/page", id="url"),
    pytest.param("an answer lead-in such as 'The special magic number is'; the lead-in's ids", id="lead-in"),
    pytest.param("nor under `/proc` or `/sys`", id="proc-sys"),
    pytest.param("sparse-attn calibrate CKPT --output DIR/calib.json", id="placeholders"),
])
def test_the_check_allows_what_is_no_machine_path(text):
    assert not any(hits([(ROOT / "x.md", 1, text)]).values())
