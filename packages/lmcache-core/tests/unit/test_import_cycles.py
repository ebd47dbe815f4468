# SPDX-License-Identifier: Apache-2.0
"""No two modules of ``packages/*/src`` import each other, directly or through a loop.

The graph is read from the source with :mod:`ast`, nothing is imported. Every ``import x`` and
``from x import y`` counts, at module level and inside functions, with relative imports resolved.
Imports under ``if TYPE_CHECKING:`` count too: two modules that name each other's types still
depend on each other, and a newcomer cannot read one without the other. ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``.
The parent packages that Python initialises on the way to a module are not edges (``import a.b``
is an edge to ``a.b`` only), or every package that re-exports its submodules would be a loop.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGES = Path(__file__).resolve().parents[3]

# Loops that other people are removing right now, each as the set of modules in it. The test
# fails when one of them is no longer a loop, so this list can only shrink: remove it then.
KNOWN_CYCLES: list[frozenset[str]] = []


def module_files() -> dict[str, Path]:
    """Every module of ``packages/*/src`` by dotted name (a package under its own name)."""
    modules: dict[str, Path] = {}
    for src in sorted(PACKAGES.glob("*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth (functions, ``if TYPE_CHECKING:``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names, relative levels resolved."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    anchor = package[: len(package) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def import_graph() -> dict[str, set[str]]:
    """``{module: modules of packages/*/src it imports}``."""
    modules = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = _base(module, path, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
        graph[module] = {t for t in targets if t in modules and t != module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The loops of ``graph``: its strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; the graph is a few hundred nodes
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def one_loop(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A shortest import path from the component's first module back to itself."""
    start = min(component)
    paths: dict[str, list[str]] = {start: [start]}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for succ in sorted(graph[node] & component):
                if succ == start:
                    return [*paths[node], start]
                if succ not in paths:
                    paths[succ] = [*paths[node], succ]
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not a loop")


def test_no_import_cycles() -> None:
    graph = import_graph()
    cycles = strongly_connected(graph)
    new = [
        " -> ".join(one_loop(graph, c)) + f"  (all of {sorted(c)})"
        for c in cycles
        if c not in KNOWN_CYCLES
    ]
    assert not new, (
        "Modules import each other (a loop):\n  "
        + "\n  ".join(new)
        + "\nExpected none. Fix: move what both need into a third module (errors into "
        "lmcache.errors), or pass a callable instead of importing the caller."
    )
    gone = [sorted(c) for c in KNOWN_CYCLES if c not in cycles]
    assert not gone, (
        f"{gone} no longer form an import loop (or the loop now has other members), but "
        "KNOWN_CYCLES still lists them: remove it from the list in "
        f"{Path(__file__).name}."
    )


# The checker itself, on small graphs whose answer is known.


def test_checker_finds_a_direct_and_a_longer_loop() -> None:
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "f"}, "f": set()}
    assert sorted(map(sorted, strongly_connected(graph))) == [["a", "b"], ["c", "d", "e"]]
    assert one_loop(graph, frozenset({"c", "d", "e"})) == ["c", "d", "e", "c"]


def test_checker_reads_nested_and_relative_imports(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from pkg import hidden\n"
        "def f():\n"
        "    from . import sibling\n"
        "    from .sub import thing\n"
    )
    tree = ast.parse(source)
    path = tmp_path / "mod.py"
    found = {
        _base("pkg.mod", path, n) + "|" + ",".join(a.name for a in n.names)
        for n in _imports(tree)
        if isinstance(n, ast.ImportFrom)
    }
    assert found == {"typing|TYPE_CHECKING", "pkg|hidden", "pkg|sibling", "pkg.sub|thing"}


def test_known_cycles_name_real_modules() -> None:
    missing = sorted(m for c in KNOWN_CYCLES for m in c if m not in module_files())
    assert not missing, (
        f"KNOWN_CYCLES names {missing}, which are not modules: remove it from the list."
    )
