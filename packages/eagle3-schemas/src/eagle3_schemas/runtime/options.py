"""Stage configs from parsed command lines: an option named as a config field sets that field."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

Config = TypeVar("Config")


def config_from_args(cls: type[Config], args: argparse.Namespace, **given: Any) -> Config:
    """``cls`` (a dataclass) with every field that an option of the same name sets; ``given``
    (the options renamed or converted on the way) wins over them."""
    names = {f.name for f in dataclasses.fields(cls)} & vars(args).keys()
    return cls(**{name: getattr(args, name) for name in names} | given)
