"""The package's import structure: no import cycles anywhere in dtrain, and the pure layers load no torch.

The import graph is read from the source (an AST scan, nothing is imported): an edge for every module-level
import, ``if TYPE_CHECKING:`` blocks left out; imports inside functions are counted separately and only
reported.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dtrain"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, module: str, is_package: bool, *, deferred: bool) -> list[tuple[str, str | None]]:
    """The import statements of ``tree`` as (module, name) pairs, name None for ``import module``: those run
    when the module loads (``deferred`` False) or those inside functions (True)."""
    found: list[tuple[str, str | None]] = []
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit_one(sub, in_function)
                continue
            visit_one(child, in_function)

    def visit_one(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import) and in_function == deferred:
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and in_function == deferred:
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            found.extend((source, alias.name) for alias in node.names)
        inner = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        visit(node, inner)

    visit(tree, False)
    return found


def _targets(pairs: list[tuple[str, str | None]], modules: dict[str, Path]) -> set[str]:
    """The modules the pairs load: ``from p import n`` loads ``p.n`` where that is a module, else ``p``."""
    targets = set()
    for source, name in pairs:
        targets.add(f"{source}.{name}" if name is not None and f"{source}.{name}" in modules else source)
    return targets


@functools.cache
def _import_pairs() -> dict[str, tuple[list[tuple[str, str | None]], list[tuple[str, str | None]]]]:
    """Module -> (its module-level imports, those inside functions), each file parsed once."""
    pairs = {}
    for name, path in _modules().items():
        tree, is_package = ast.parse(path.read_text(), str(path)), path.name == "__init__.py"
        pairs[name] = tuple(_imports(tree, name, is_package, deferred=deferred) for deferred in (False, True))
    return pairs


@functools.cache
def import_graph(*, deferred: bool = True) -> dict[str, set[str]]:
    """Module -> the dtrain modules it imports: module-level imports, and with ``deferred`` those inside
    functions too."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (loaded, inside) in _import_pairs().items():
        pairs = loaded + inside if deferred else loaded
        graph[name] = {n for n in _targets(pairs, modules) if n in modules and n != name}
    return graph


@functools.cache
def external_imports(module: str) -> set[str]:
    """Top-level names of the non-dtrain packages ``module`` imports at module level."""
    return {
        source.split(".")[0] for source, _ in _import_pairs()[module][0] if source and not source.startswith("dtrain")
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) for every strongly connected component with more than one module
    (or a module importing itself); Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_a_cycle(graph, set(c), c[0]) for c in components]


def _a_cycle(graph: dict[str, set[str]], members: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside one component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"{start} is in a component but on no cycle")


def test_the_scan_finds_a_cycle_and_ignores_type_checking_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import x.y\nimport x.z\n"
    tree = ast.parse(source + "def f():\n    import x.w\n")
    assert _imports(tree, "m", False, deferred=False) == [("typing", "TYPE_CHECKING"), ("x.z", None)]
    assert _imports(tree, "m", False, deferred=True) == [("x.w", None)]


def test_relative_imports_resolve_against_the_package():
    tree = ast.parse("from . import a\nfrom ..b import c\n")
    assert _imports(tree, "p.q.m", False, deferred=False) == [("p.q", "a"), ("p.b", "c")]
    assert _imports(tree, "p.q", True, deferred=False) == [("p.q", "a"), ("p.b", "c")]
    modules = dict.fromkeys(["p.q", "p.q.a", "p.b"], Path())
    assert _targets([("p.q", "a"), ("p.b", "c")], modules) == {"p.q.a", "p.b"}


@pytest.mark.parametrize("deferred", [False, True], ids=["module-level", "with-function-level"])
def test_no_import_cycles_in_dtrain(deferred):
    found = cycles(import_graph(deferred=deferred))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


PURE = ["dtrain.env", "dtrain.comm.ir", "dtrain.comm.cost", "dtrain.comm.cost.model", "dtrain.comm.cost.forms"]
PURE += ["dtrain.comm.cost.params", "dtrain.comm.cost.rules", "dtrain.comm.peer", "dtrain.comm.peer.pull"]
PURE += ["dtrain.comm.peer.push"]
PURE += ["dtrain.comm.ir.schedule", "dtrain.comm.ir.check", "dtrain.comm.ir.plan", "dtrain.comm.ir.algorithms"]


@pytest.mark.parametrize("module", PURE)
def test_the_pure_layers_import_no_torch_at_module_level(module):
    graph = import_graph(deferred=False)
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph[m])
    heavy = {m: external_imports(m) & {"torch", "triton"} for m in seen}
    assert not {m: h for m, h in heavy.items() if h}, f"{module} reaches torch through {heavy}"


def test_the_pure_layers_import_no_torch_when_loaded():
    code = f"import sys; import {', '.join(PURE)}; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert result.stdout == "[]\n"


@functools.cache
def _defined(path: Path) -> frozenset[str] | None:
    """The names ``path`` binds at module level (in ``if`` and ``try`` blocks too), with those of its ``__all__``
    where a module ``__getattr__`` loads them on first use; None where a star import makes them unknowable from
    the source."""
    names: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))

    def bind(target: ast.AST) -> None:
        for node in ast.walk(target):
            if isinstance(node, ast.Name):
                names.add(node.id)

    def visit(body: list[ast.stmt]) -> bool:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target)
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                bind(node.target)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                if any(alias.name == "*" for alias in node.names):
                    return False
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
            elif isinstance(node, ast.If | ast.Try | ast.With | ast.For):
                blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
                blocks += [handler.body for handler in getattr(node, "handlers", [])]
                if not all(visit(block) for block in blocks):
                    return False
        return True

    if not visit(tree.body):
        return None
    if "__getattr__" in names:
        values = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign) for t in node.targets
                  if isinstance(t, ast.Name)}  # fmt: skip

        def strings(value: ast.AST | None) -> list[str]:  # a list or tuple of strings, *NAME spliced in
            out = []
            for elt in getattr(value, "elts", []):
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                    out.append(elt.value)
                elif isinstance(elt, ast.Starred) and isinstance(elt.value, ast.Name):
                    out += strings(values.get(elt.value.id))
            return out

        names.update(strings(values.get("__all__")))
    return frozenset(names)


def test_every_name_imported_from_dtrain_is_defined_there():
    """``from dtrain.x import name`` anywhere in the package or the benchmarks (inside functions too, where only the
    path that runs it would find a name that moved) names a module or something ``dtrain.x`` defines."""
    modules = _modules()
    missing = []
    pairs = {module: loaded + inside for module, (loaded, inside) in _import_pairs().items()}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):  # the benchmarks import from the package too
        tree = ast.parse(path.read_text(), str(path))
        pairs[str(path.relative_to(ROOT))] = [
            pair for deferred in (False, True) for pair in _imports(tree, "benchmarks", True, deferred=deferred)
        ]
    for module, imported in pairs.items():
        for source, name in imported:
            if name is None or not source.startswith("dtrain") or f"{source}.{name}" in modules:
                continue
            defined = _defined(modules[source]) if source in modules else set()
            if defined is not None and name not in defined:
                missing.append(f"{module}: from {source} import {name}")
    assert not missing, "\n".join(missing)
