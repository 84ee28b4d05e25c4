"""Plain YAML values into typed dataclasses, strictly: an unknown key or a wrong type is a
ConfigError naming the key, the value found and what was expected."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """The configuration cannot describe a run."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# What PyYAML (YAML 1.1) reads as a boolean: `mixed_precision: no` arrives as False.
_YAML11_BOOLS = {
    False: ("no", "n", "off", "false"),
    True: ("yes", "y", "on", "true"),
}


def _yaml11_word(value: Any, choices: tuple[Any, ...]) -> Any:
    """The one choice a boolean was typed as (``no`` for a Literal holding "no"), else
    ``value`` unchanged."""
    if not isinstance(value, bool):
        return value
    typed = [c for c in choices if isinstance(c, str) and c.lower() in _YAML11_BOOLS[value]]
    return typed[0] if len(typed) == 1 else value


def coerce(value: Any, tp: Any, where: str) -> Any:
    """``value`` checked (and widened where lossless) against the annotation ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(
            errors[0] if len(errors) == 1 else f"{where}: {value!r} fits none of {tp}"
        )
    if origin is Literal:
        value = _yaml11_word(value, args)
        if value not in args:
            raise ConfigError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, found {type(value).__name__} {value!r}")
        return [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, found {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, found {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, found {value!r}")
        return value
    if tp is float:
        # PyYAML (YAML 1.1) reads 3e-4 without a dot as a string; accept what users type.
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: expected a number, found {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer past the largest float
            raise ConfigError(f"{where}: {value} is too large for a number") from None
        if math.isnan(number):  # every comparison of the checks is false for NaN
            raise ConfigError(f"{where}: expected a number, found NaN")
        if math.isinf(number):  # passes "> 0"; no setting of a run means infinity
            raise ConfigError(f"{where}: expected a finite number, found {number}")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, found {value!r}")
        return value
    if tp is Any:
        return value
    raise ConfigError(f"{where}: unsupported config type {_type_name(tp)}")


def build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, found {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(data) - known))  # YAML keys may be numbers, null, ...
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; known keys: {', '.join(sorted(known))}"
        )
    kwargs = {
        name: coerce(value, hints[name], f"{where}.{name}" if where else name)
        for name, value in data.items()
    }
    return cls(**kwargs)


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
