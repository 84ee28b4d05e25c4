"""The import paths the library's modules had before they moved into rooms.

``eagle3_schemas.atomic`` is ``eagle3_schemas.io.atomic`` now, and so on (``MOVED``). Scripts that
still name an old path keep working for one release: each old path is a small module object in
``sys.modules`` whose names resolve to the new module, with a ``DeprecationWarning`` naming the
new path. Nothing is imported until a name is used, and this code imports no other module of the
library (the names below are strings). Listed in CHANGELOG.md; removed in the next release.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from typing import Any

# Old module name -> its room, under eagle3_schemas.
MOVED = {
    "artifact": "contract",
    "checks": "contract",
    "header": "contract",
    "lineage": "contract",
    "meta_check": "contract",
    "paths": "contract",
    "registry": "contract",
    "stream": "contract",
    "validate": "contract",
    "atomic": "io",
    "diskspace": "io",
    "fingerprint": "io",
    "jsonl": "io",
    "safetensors_format": "io",
    "conversations": "layouts",
    "draft_layout": "layouts",
    "draft_vocab": "layouts",
    "hidden_states": "layouts",
    "model_card": "layouts",
    "remote_code": "layouts",
    "target_config": "layouts",
    "cuda_driver": "runtime",
    "failures": "runtime",
    "options": "runtime",
    "signals": "runtime",
}


class MovedModule(types.ModuleType):
    """An old import path: each name read from it warns once per place and comes from ``new``."""

    def __init__(self, old: str, new: str) -> None:
        super().__init__(old, f"Moved to {new}; this path goes in the next release.")
        self.__dict__["_new"] = new

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # introspection (inspect, pickle, pytest) reads these freely
            raise AttributeError(name)
        new = self.__dict__["_new"]
        warnings.warn(
            f"{self.__name__} moved to {new}: import {name} from there "
            "(the old path goes in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(new), name)

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self.__dict__["_new"]))


def install(package: types.ModuleType) -> None:
    """Register every old path under ``package``, and as its attribute where the package has
    none of its own (``eagle3_schemas.validate`` stays the function, as it always was)."""
    for old, room in MOVED.items():
        name = f"{package.__name__}.{old}"
        module = sys.modules.setdefault(name, MovedModule(name, f"{package.__name__}.{room}.{old}"))
        if not hasattr(package, old):
            setattr(package, old, module)
