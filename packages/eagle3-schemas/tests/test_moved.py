"""The import paths from before the rooms still import for one release, each with a warning."""

from __future__ import annotations

import importlib

import pytest

import eagle3_schemas
from eagle3_schemas.contract import validate as validate_module
from eagle3_schemas.io import atomic
from eagle3_schemas.moved import MOVED


def test_an_old_path_imports_and_warns() -> None:
    with pytest.warns(
        DeprecationWarning, match=r"eagle3_schemas\.atomic moved to eagle3_schemas\.io\.atomic"
    ):
        from eagle3_schemas.atomic import write_json_atomic
    assert write_json_atomic is atomic.write_json_atomic


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_old_path_names_its_new_module(old: str) -> None:
    module = importlib.import_module(f"eagle3_schemas.{old}")
    new = importlib.import_module(f"eagle3_schemas.{MOVED[old]}.{old}")
    # a class or function the new module defines itself (not one it imports)
    public = next(n for n, v in vars(new).items() if getattr(v, "__module__", "") == new.__name__)
    with pytest.warns(DeprecationWarning, match=f"{new.__name__}"):
        assert getattr(module, public) is getattr(new, public)


def test_the_package_keeps_its_own_names() -> None:
    """``eagle3_schemas.validate`` was the function before the rooms and stays it."""
    assert eagle3_schemas.validate is validate_module.validate
