"""The project's import graph has no cycle (issue 18 item 7), and its packages are layered
(issue 31 item 3): every import between two packages is an arrow of :data:`ALLOWED`.

Every ``import`` statement counts, including the ones inside functions: a
function-local import only hides a cycle until the function runs. Edges from
a module to its own parent packages are left out, since Python always runs a
package's ``__init__`` before its submodules and that is not a cycle between
two modules that need each other.

A cycle test cannot see a layer inversion that is not (yet) a cycle: calibration reading eval's
tasks while eval read calibration's private word lists, or the version-free kernels reading
``compat``'s registry. The layering test does: each module belongs to a *layer* (``compat`` as a
whole; each subpackage or top-level module of ``sparse_attn``; ``benchmarks``), every edge between
two layers must be in the table, and no import reaches a private (``_name``) attribute of
another layer.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("compat", "sparse_attn")
#: Scanned for layering only: scripts that may import any layer, but no private names.
SCRIPTS = ("benchmarks",)


def _modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (see :func:`_edges`)."""
    return {edge.target for edge in _edges(name, path, modules)}


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


# --------------------------------------------------------------------------- layering
#: layer -> the layers it may import (sparse_attn's layers without the ``sparse_attn.`` prefix).
#: Arrows point one way: compat knows nothing of sparse_attn; the leaves (errors, jsonio,
#: protocol) import nothing of the project; the kernels read only their settings; workloads (the
#: prompts and tasks) sit below every command that runs them. A new arrow is a design decision:
#: add it here, in the commit that needs it, and say why.
ALLOWED: dict[str, frozenset[str]] = {name: frozenset(deps) for name, deps in {
    "compat": (),
    "sparse_attn": (),
    "errors": (),
    "jsonio": (),
    "protocol": (),
    "settings": ("compat", "protocol"),  # built on compat.envs' registry machinery, the one list of variables
    "kernels": ("settings",),
    "stats": ("protocol",),
    "config": ("jsonio", "kernels", "protocol"),  # kernels: effective_lambda, the one home of the dense rule
    "workloads": ("compat", "errors", "jsonio"),  # compat: the model's length limit as vLLM reads it
    "models": ("errors",),
    "adapter": ("compat", "kernels", "protocol", "settings", "stats"),
    "warmup": ("kernels", "protocol", "stats"),  # the install warm-up: kernel launches, the stats counters
    "plugin": ("adapter", "compat", "config", "kernels", "protocol", "settings", "stats", "warmup"),
    "calibration": ("compat", "config", "errors", "jsonio", "kernels", "protocol", "settings", "workloads"),
    # jsonio: the report a user hands back to `python -m sparse_attn.evaluation.plot` to redraw it
    "evaluation": ("compat", "config", "errors", "jsonio", "protocol", "settings", "workloads"),
    "demo": ("compat", "config", "errors", "models", "protocol", "settings", "workloads"),
    "cli": ("calibration", "compat", "config", "demo", "errors", "evaluation", "jsonio", "models", "protocol",
            "settings", "workloads"),
    "__main__": ("cli",),
}.items()}
#: Scripts outside the packages may import every layer (but no private name of one).
ANY = frozenset(ALLOWED)


def layer_of(module: str) -> str:
    """``compat.probe`` -> ``compat``; ``sparse_attn.kernels.api`` -> ``kernels``; ``sparse_attn`` -> ``sparse_attn``;
    ``benchmarks.bench_x`` -> ``benchmarks``."""
    top, _, rest = module.partition(".")
    if top != "sparse_attn":
        return top
    return rest.partition(".")[0] or "sparse_attn"


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported module
    where: str  # file:line
    private: str | None = None  # the private name reached, when there is one


def _edges(name: str, path: Path, modules: dict[str, Path], root: Path = ROOT) -> list[Edge]:
    """Every import of a project module by ``name`` (function-local ones too), with its line, and each
    private attribute it reaches: ``from m import _x`` or ``alias._x`` on a module bound by an import."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def where(node: ast.stmt | ast.expr) -> str:
        return f"{path.relative_to(root)}:{node.lineno}"

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    found: list[Edge] = []
    bound: dict[str, str] = {}  # local name -> project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (target := resolve(alias.name)) is not None:
                    found.append(Edge(name, target, where(node)))
                    if alias.asname:
                        bound[alias.asname] = target
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            for alias in node.names:
                full = f"{stem}.{alias.name}"
                if full in modules:
                    found.append(Edge(name, full, where(node)))
                    bound[alias.asname or alias.name] = full
                elif (target := resolve(stem)) is not None:
                    private = alias.name if alias.name.startswith("_") and not alias.name.startswith("__") else None
                    found.append(Edge(name, target, where(node), private))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(Edge(name, bound[node.value.id], where(node), node.attr))
    line = lambda e: int(e.where.rpartition(":")[2])  # noqa: E731
    return sorted(dict.fromkeys(e for e in found if e.target != name and not name.startswith(e.target + ".")), key=line)


def layering_violations(modules: dict[str, Path], allowed: dict[str, frozenset[str]], root: Path = ROOT) -> list[str]:
    """One line per import between two layers that the table does not allow, and per private name
    reached across layers; each names the file and line."""
    problems = []
    for name, path in sorted(modules.items()):
        source = layer_of(name)
        for edge in _edges(name, path, modules, root):
            target = layer_of(edge.target)
            if target == source:
                continue
            if edge.private is not None:
                problems.append(f"{edge.where}: {name} reaches the private name {edge.private} of {edge.target} "
                                f"(layer {target}); give it a public name or move it")
            elif target not in allowed.get(source, ANY if source in SCRIPTS else frozenset()):
                problems.append(f"{edge.where}: {name} imports {edge.target}, but layer {source} may import only "
                                f"{', '.join(sorted(allowed.get(source, ()))) or 'nothing of the project'}")
    return problems


def test_every_import_between_layers_is_an_allowed_arrow():
    modules = {**_modules(), **_modules(SCRIPTS)}
    assert set(map(layer_of, _modules())) <= set(ALLOWED), "a new layer needs its row in ALLOWED"
    problems = layering_violations(modules, ALLOWED)
    assert not problems, "layering (tests/sparse_attn/test_import_graph.py ALLOWED):\n" + "\n".join(problems)


def test_the_allowed_table_has_no_cycle():
    """The table itself points one way, so no sequence of allowed imports can form a cycle between layers."""
    assert not _cycles({layer: set(deps) for layer, deps in ALLOWED.items()})
    assert all(dep in ALLOWED for deps in ALLOWED.values() for dep in deps)


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    modules = {}
    for name, text in files.items():
        path = ROOT / f"{name.replace('.', '/')}.py"
        fake = tmp_path / path.relative_to(ROOT)
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_text(text)
        modules[name] = fake
    return modules


@pytest.mark.parametrize("files, expected", [
    pytest.param({"sparse_attn.kernels.cpu_impl": "def f():\n    from compat import envs\n", "compat": ""},
                 ["cpu_impl.py:2: sparse_attn.kernels.cpu_impl imports compat, but layer kernels may import only settings"],
                 id="kernels-to-compat"),
    pytest.param({"sparse_attn.calibration.cli": "from sparse_attn.evaluation.tasks import EVAL_TASKS\n",
                  "sparse_attn.evaluation.tasks": ""},
                 ["cli.py:1: sparse_attn.calibration.cli imports sparse_attn.evaluation.tasks, but layer calibration may"],
                 id="calibration-to-evaluation"),
    pytest.param({"sparse_attn.workloads.tasks": "from sparse_attn.calibration import synthetic as syn\nx = syn._essay\n",
                  "sparse_attn.calibration.synthetic": ""},
                 ["tasks.py:1: sparse_attn.workloads.tasks imports sparse_attn.calibration.synthetic",
                  "tasks.py:2: sparse_attn.workloads.tasks reaches the private name _essay of sparse_attn.calibration.synthetic"],
                 id="private-attribute"),
    pytest.param({"sparse_attn.demo.run": "from sparse_attn.models import _require_converters\n", "sparse_attn.models": ""},
                 ["run.py:1: sparse_attn.demo.run reaches the private name _require_converters of sparse_attn.models"],
                 id="private-import"),
    pytest.param({"compat.launch": "import sparse_attn.protocol\n", "sparse_attn.protocol": ""},
                 ["launch.py:1: compat.launch imports sparse_attn.protocol, but layer compat may import only nothing"],
                 id="compat-to-sparse_attn"),
    pytest.param({"sparse_attn.evaluation.run": "from sparse_attn.workloads.lengths import TASK_PROMPT_MARGIN\n",
                  "sparse_attn.workloads.lengths": ""}, [], id="allowed-arrow"),
])
def test_the_layering_check_names_each_violation(tmp_path, files, expected):
    """Guards the check: each kind of violation is found, at its file and line (the first three are the
    back-edges issue 31 found: kernels -> compat, calibration -> evaluation, and eval reading
    calibration's private word lists)."""
    problems = layering_violations(_tree(tmp_path, files), ALLOWED, root=tmp_path)
    assert len(problems) == len(expected), problems
    for problem, start in zip(problems, expected):
        assert start in problem, problem
