"""The package's layers, checked from its source: no import circle, and no layer reaching up to a higher one.

Every ``import`` and ``from ... import`` statement counts, at module level or inside a function (a
function-level import is a dependency all the same, only a later one); an ``if TYPE_CHECKING:`` block does
not (nothing runs it). A package's ``__init__`` that names its exports lazily (PEP 562, a table of strings)
imports nothing, so it adds no edge.

The layers, lowest first (a module may import from its own layer and any lower one):

0. leaves: ``_perm``, ``errors``, ``specs``, ``records``, ``state``
1. what reads bytes and text: ``storage``, ``readers``, ``tokenization``, ``imaging``
2. the declarations: ``read`` (sources) and ``ops`` (operators)
3. ``plan`` (the closed-form work plan), and ``recipe.to_toml`` (it reads operators' declarations, no builder:
   ``Pipeline.to_recipe()`` uses it)
4. ``engine`` (lanes, nodes, hosts, runners) and ``batches`` (collation)
5. ``graph`` (a pipeline compiled to what its lanes run)
6. ``loader`` (a rank's loader)
7. ``pipeline`` (the builder)
8. ``recipe`` (the TOML front end)
9. the tools: ``verify``, ``testing``, ``cli``, ``demo``, ``__main__``
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "zephon"
LAYERS = [
    ["_perm", "errors", "specs", "records", "state"],
    ["storage", "readers", "tokenization", "imaging", "origins"],
    ["read", "ops"],
    ["plan", "recipe.to_toml"],
    ["engine", "batches"],
    ["graph"],
    ["loader"],
    ["pipeline"],
    ["recipe"],
    ["verify", "testing", "cli", "demo", "__main__", "provenance"],
]


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The zephon modules ``name`` imports, anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):  # what only type checkers read is no dependency
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            node.body = []
    out = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t.startswith("zephon") and t != name:
                out.add(t)
    return out


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on, stack, out = set(), [], []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def layer(name: str) -> int | None:
    """The layer of a module: of the longest entry of :data:`LAYERS` it is, or is inside."""
    rel = name.partition(".")[2]
    if not rel:
        return None  # the package itself: its lazy exports name every layer
    found = [(len(entry), k) for k, names in enumerate(LAYERS) for entry in names
             if rel == entry or rel.startswith(entry + ".")]
    if found:
        return max(found)[1]
    raise AssertionError(f"{name} is in no layer: add its folder or module to LAYERS (tests/test_layering.py)")


def test_there_is_no_import_circle(graph):
    assert cycles(graph) == []


def test_no_module_imports_from_a_higher_layer(graph):
    upward = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})" for a, deps in graph.items() for b in deps
              if layer(a) is not None and layer(b) is not None and layer(b) > layer(a)]  # type: ignore[operator]
    assert upward == []


def test_the_checks_catch_a_circle_and_an_upward_import():
    """The checks themselves: a made-up circle is found, and so is an upward edge."""
    assert cycles({"zephon.a": {"zephon.b"}, "zephon.b": {"zephon.c"}, "zephon.c": {"zephon.a"}, "zephon.d": set()}) \
        == [["zephon.a", "zephon.b", "zephon.c"]]
    assert layer("zephon.ops.pack") == 2 and layer("zephon.pipeline") == 7 and layer("zephon.engine.lane") == 4


def test_ray_is_brought_in_by_the_runners_alone(graph):
    """One registry for runners: the Ray-backed engine modules are imported by zephon.engine.runners only
    (and by each other: the local head for tests and notebooks, ray_local, disconnects through the executor's
    connection)."""
    ray = {"zephon.engine.ray_executor", "zephon.engine.ray_lanes", "zephon.engine.ray_local"}
    users = sorted(a for a, deps in graph.items() if deps & ray and a not in ray)
    assert users == ["zephon.engine.runners"]


def test_the_package_modules_import_nothing_at_import_time():
    """zephon/__init__.py and zephon/recipe/__init__.py only name their exports (imported on first use), and
    zephon/ops/__init__.py is a docstring: importing one operator's module imports no other."""
    for init in (ROOT / "__init__.py", ROOT / "recipe" / "__init__.py", ROOT / "ops" / "__init__.py"):
        tree = ast.parse(init.read_text(encoding="utf-8"))
        eager = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                 and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
                 and not (isinstance(n, ast.Import) and all(a.name in ("importlib",) for a in n.names))
                 and not (isinstance(n, ast.ImportFrom) and n.module == "typing")]
        assert eager == [], (init, [ast.unparse(n) for n in eager])
