"""The recipes' own Python, for the tests: ``recipes/recipe_targets.py``.

The recipes' pipelines run that file as a script and recipes/ is not a package, so it is
imported here by path, once, under its own name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


recipe_targets = _load("recipe_targets")
