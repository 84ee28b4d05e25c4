"""The source files a module imports from named packages, followed import by import and read
from the sources (so the set does not depend on what the calling process has imported): what
a cache keyed by content hashes."""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterable
from pathlib import Path


def followed_imports(path: Path, packages: tuple[str, ...]) -> set[str]:
    """Names of the ``packages``' modules a source file imports, at any depth of its code."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.split(".")[0] in packages)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in packages:
            names.add(node.module)
            package = importlib.util.find_spec(node.module)
            if package is None or package.submodule_search_locations is None:
                continue  # a module: its names are functions and classes
            for alias in node.names:  # "from eagle3_eval import draft" may name a module
                if importlib.util.find_spec(f"{node.module}.{alias.name}") is not None:
                    names.add(f"{node.module}.{alias.name}")
    return names


def module_sources(names: Iterable[str], packages: tuple[str, ...]) -> dict[str, Path]:
    """Each module of ``names`` and every module of ``packages`` it imports, at any depth:
    module name -> its source file."""
    todo, sources = list(names), {}
    while todo:
        name = todo.pop()
        if name in sources:
            continue
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        sources[name] = Path(spec.origin)
        todo += followed_imports(sources[name], packages)
    return sources
