"""Fuzzed training config: any YAML file and any ``--set KEY=VALUE`` load or fail by name.

Two properties over the real loader (``load_config``, ``parse_override``):

- a valid config with one key set to any YAML value, in the file or by ``--set`` (known keys at
  every depth, unknown ones too): a ``Config``, or a ``ConfigError`` whose message names that key;
- any text as the config file, and any text as a ``--set``: a ``Config`` or a ``ConfigError``.

Never another exception.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given
from hypothesis import strategies as st

from eagle3_train.config.coerce import ConfigError
from eagle3_train.config.run_config import Config, load_config, parse_override

from support.fuzz import FUZZ, json_of, outcome

READER = "train config + --set"
BASE = {"data": {"hidden_states": "hs", "vocab_map": "vocab_map.safetensors"}}


def _leaves(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, dict):
        out = [prefix] if prefix else []
        for key, child in value.items():
            out += _leaves(child, f"{prefix}.{key}" if prefix else key)
        return out
    return [prefix]


KNOWN = sorted(_leaves(dataclasses.asdict(Config())))
KEYS = st.sampled_from(KNOWN) | st.builds(
    lambda k, extra: f"{k}.{extra}" if k else extra,
    st.sampled_from(["", "train", "data", "draft.init_from", "train.muon"]),
    st.sampled_from(["lr", "nope", "x_y", "0", "train"]),
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.sampled_from([10**400, -(10**400), 0, 1, -1, 2])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["3e-4", "no", "off", "auto", "sglang", "mla", "SIGTERM", "USR1", "nan", ""])
)
VALUES = json_of(SCALARS)


def _nested(key: str, value: Any) -> dict[str, Any]:
    node: Any = value
    for part in reversed(key.split(".")):
        node = {part: node}
    return node


def _load(text: str | None, sets: list[str]) -> Config:
    with tempfile.TemporaryDirectory() as tmp:
        path = None
        if text is not None:
            path = Path(tmp) / "config.yaml"
            path.write_text(text, encoding="utf-8", errors="surrogatepass")
        return load_config(path, [parse_override(s) for s in sets])


@FUZZ
@given(key=KEYS, value=VALUES, by_set=st.booleans())
def test_one_key_set_to_any_value_loads_or_names_the_key(
    key: str, value: Any, by_set: bool
) -> None:
    try:
        typed = yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip()
    except yaml.YAMLError:  # not representable as YAML (cannot come from a file)
        typed = None
    if by_set and typed is not None and typed.endswith("\n..."):
        typed = typed[: -len("\n...")]
    if by_set and typed is not None:
        text, sets = yaml.safe_dump(BASE), [f"{key}={typed}"]
    else:
        text, sets = (
            yaml.safe_dump({**BASE, **_nested(key, value)} if "." in key else {**BASE, key: value}),
            [],
        )
    result = outcome(READER, lambda: _load(text, sets), (ConfigError,))
    if isinstance(result, ConfigError):
        assert key.split(".")[-1] in str(result) or key.split(".")[0] in str(result), (
            key,
            str(result),
        )


@FUZZ
@given(
    text=st.text(max_size=80)
    | st.sampled_from(["[" * 1000, "a: " + "[" * 1000, "x: !!python/object:os.system ls"]),
    sets=st.lists(
        st.text(max_size=20) | st.builds(lambda k, v: f"{k}={v}", KEYS, st.text(max_size=10)),
        max_size=2,
    ),
)
def test_any_text_as_config_file_or_set(text: str, sets: list[str]) -> None:
    outcome(READER, lambda: _load(text, sets), (ConfigError,))
