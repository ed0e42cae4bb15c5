"""The package's limits hold: no module over 500 lines, no function over 80, and no import
circle between its modules (type-only imports included: a circle is one whichever way it is
written). Read from the source with `ast`, so a breach fails the suite, not a review."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "noisy_temp_server"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _imported(name: str, tree: ast.AST) -> set[str]:
    """The package's modules that module `name` imports, at any depth (function-local and
    type-only imports included); `from package import module` counts as the module."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{name}: a relative import (the package imports absolutely)"
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & MODULES.keys()
            names_only = len(submodules) < len(node.names)
            found |= submodules | ({node.module or ""} if names_only else set())
    return {module for module in found if module in MODULES and module != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


@pytest.mark.parametrize("name", sorted(MODULES))
def test_the_module_and_its_functions_stay_small(name: str) -> None:
    text = MODULES[name].read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines (at most {MAX_MODULE_LINES})"
    long = {
        function.name: function.end_lineno - function.lineno + 1  # type: ignore[operator]
        for function in _functions(ast.parse(text))
        if function.end_lineno - function.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
    }
    assert not long, f"{name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_no_import_circle_between_the_modules() -> None:
    graph = {
        name: _imported(name, ast.parse(path.read_text(encoding="utf-8")))
        for name, path in MODULES.items()
    }
    assert _circles(graph) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
