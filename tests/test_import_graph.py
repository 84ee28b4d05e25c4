"""No import circles in any package, counting every import the code can execute.

import-linter's contracts see module-level imports; an import placed inside a function (or
under ``TYPE_CHECKING``) to dodge a circle is still a circle (ARCHITECTURE.md). So this walks
the syntax tree of every module of every package under ``packages/*/src`` (whatever modules a
package has today) and follows each ``import`` and ``from ... import``, relative forms included,
wherever it stands. A circle fails the test, named module by module with file and line.

Edges go to the module an import names (``from pkg import mod`` to ``pkg.mod`` when that is a
module, else to ``pkg``), not to the parent packages Python initialises on the way: a submodule
importing its own package's ``__init__`` attribute is a real edge, the implicit parent import is
not (it is already under way whenever a submodule loads).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    file: Path
    line: int


def package_modules(src_dirs: list[Path]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``), for every package in ``src_dirs``."""
    modules: dict[str, tuple[Path, bool]] = {}
    for src in src_dirs:
        for init in sorted(src.glob("*/__init__.py")):
            for file in sorted(init.parent.rglob("*.py")):
                parts = file.relative_to(src).with_suffix("").parts
                is_package = parts[-1] == "__init__"
                modules[".".join(parts[:-1] if is_package else parts)] = (file, is_package)
    return modules


def _imported_names(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    """Dotted names an import statement may load, ``from`` targets as ``base.name``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: level 1 is the importing module's own package
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names if alias.name != "*")


def _known(name: str, modules: dict[str, tuple[Path, bool]]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules``."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_edges(modules: dict[str, tuple[Path, bool]]) -> dict[str, list[Edge]]:
    """Every import between ``modules``, wherever in the file it stands."""
    edges: dict[str, list[Edge]] = {name: [] for name in modules}
    for name, (file, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            names = list(_imported_names(node, package))
            if isinstance(node, ast.ImportFrom):
                # ``from base import x``: the submodule base.x when it is one, else base itself.
                submodules = [n for n in names[1:] if n in modules]
                names = submodules + ([names[0]] if len(submodules) < len(names) - 1 else [])
            for target in {t for n in names if (t := _known(n, modules)) and t != name}:
                edges[name].append(Edge(name, target, file, node.lineno))
    return edges


def strongly_connected(edges: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (the circles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for edge in edges[v]:
            w = edge.target
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def shortest_cycle(start: str, members: set[str], edges: dict[str, list[Edge]]) -> list[Edge]:
    """The shortest path of imports from ``start`` back to itself inside one component."""
    paths: dict[str, list[Edge]] = {start: []}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for edge in edges[v]:
                if edge.target == start:
                    return [*paths[v], edge]
                if edge.target in members and edge.target not in paths:
                    paths[edge.target] = [*paths[v], edge]
                    following.append(edge.target)
        frontier = following
    raise AssertionError(f"{start} is in a component but on no cycle")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def circles(src_dirs: list[Path]) -> list[str]:
    """One message per circle: its modules, then one cycle through them with files and lines."""
    edges = import_edges(package_modules(src_dirs))
    messages = []
    for component in strongly_connected(edges):
        cycle = shortest_cycle(component[0], set(component), edges)
        steps = "\n".join(
            f"    {e.source} -> {e.target}  ({_shown(e.file)}:{e.line})" for e in cycle
        )
        messages.append(f"circle of {len(component)} modules {component}, e.g.:\n{steps}")
    return messages


def _src_dirs() -> list[Path]:
    return sorted({p.parents[1] for p in ROOT.glob("packages/*/src/*/__init__.py")})


def test_no_package_has_an_import_circle() -> None:
    src_dirs = _src_dirs()
    members = sorted(p.parent.name for p in ROOT.glob("packages/*/pyproject.toml"))
    assert [d.parent.name for d in src_dirs] == members, (
        f"packages without a src/<package>/__init__.py the walk would miss: {members}"
    )
    found = circles(src_dirs)
    assert not found, "import circles (an import inside a function counts too):\n" + "\n".join(
        found
    )


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "src" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "src"


# One circle, pkg.a -> pkg.b -> pkg.a, closed by each import form the walk must follow.
CLOSING_IMPORTS = {
    "in a function": "def f():\n    from pkg.a import x\n",
    "relative module": "from . import a\n",
    "relative name": "from .a import x\n",
    "plain import": "import pkg.a\n",
    "type checking only": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n",
    "package attribute": "from pkg import x\n",
}


@pytest.mark.parametrize("form", CLOSING_IMPORTS)
def test_a_planted_circle_is_named_with_its_lines(tmp_path: Path, form: str) -> None:
    closing = CLOSING_IMPORTS[form]
    init = "from pkg.a import x\n" if form == "package attribute" else ""
    src = _write(
        tmp_path,
        {
            "pkg/__init__.py": init,
            "pkg/a.py": "import os\nfrom pkg.b import y\nx = 1\n",
            "pkg/b.py": f"y = 2\n{closing}",
        },
    )
    found = circles([src])
    assert len(found) == 1, found
    assert "pkg.b -> pkg" in found[0] and "b.py:" in found[0], found[0]
    acyclic = _write(tmp_path / "clean", {"pkg/__init__.py": init, "pkg/a.py": "x = 1\n"})
    assert circles([acyclic]) == []


def _test_files() -> list[Path]:
    return sorted(
        {
            *ROOT.glob("conftest.py"),
            *ROOT.glob("tests/**/*.py"),
            *ROOT.glob("packages/*/tests/**/*.py"),
        }
    )


def _reaches_into_tools(tree: ast.AST, tool_modules: set[str]) -> Iterator[tuple[int, str]]:
    """Imports of a tools/ module by name, and edits of sys.path (how such imports are made)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                if not getattr(node, "level", 0) and (name or "").split(".")[0] in tool_modules:
                    yield node.lineno, f"imports {name} (tools/)"
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        ):
            yield node.lineno, "uses sys.path (tests import through pytest's pythonpath)"


def test_no_test_imports_from_tools() -> None:
    """tools/ is what a person runs by hand; tests share tests/support instead (found here by
    name, and any sys.path edit that would make a tool importable)."""
    tool_modules = {p.stem for p in ROOT.glob("tools/**/*.py")}
    assert tool_modules, "no Python file under tools/: the check would see nothing"
    found = [
        f"{_shown(file)}:{line}: {what}"
        for file in _test_files()
        for line, what in _reaches_into_tools(ast.parse(file.read_text()), tool_modules)
    ]
    assert not found, "tests reaching into tools/:\n" + "\n".join(found)
