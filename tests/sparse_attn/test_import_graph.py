"""The project's import graph has no cycle (issue 18 item 7).

Every ``import`` statement counts, including the ones inside functions: a
function-local import only hides a cycle until the function runs. Edges from
a module to its own parent packages are left out, since Python always runs a
package's ``__init__`` before its submodules and that is not a cycle between
two modules that need each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compat", "sparse_attn")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
            targets = [f"{stem}.{alias.name}" if f"{stem}.{alias.name}" in modules else stem for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                out.add(target)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_the_project_import_graph_has_no_cycle():
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles (function-local imports included): " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("graph,expected", [
    pytest.param({"a": {"b"}, "b": {"a"}}, [["a", "b"]], id="two_module_cycle"),
    pytest.param({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]], id="three_module_cycle"),
    pytest.param({"a": {"b"}, "b": {"c"}, "c": set()}, [], id="chain"),
])
def test_the_cycle_finder_finds_cycles(graph, expected):
    assert _cycles(graph) == expected


def test_function_local_imports_are_edges():
    # The cycle issue 18 item 7 named went through a function-local import in sparse_attn.cli.
    graph = _graph()
    assert "sparse_attn.calibration.cli" in graph["sparse_attn.cli"]
    assert "sparse_attn.cli" not in graph["sparse_attn.calibration.cli"]
