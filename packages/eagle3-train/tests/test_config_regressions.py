"""Configs the fuzzed loader (test_fuzz_config.py) found raising something other than
ConfigError, each minimal: a ConfigError naming the key or the file now."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_train.config.coerce import ConfigError
from eagle3_train.config.run_config import load_config, parse_override

BASE = [parse_override("data.hidden_states=hs"), parse_override("data.vocab_map=v.safetensors")]


def test_integer_too_large_for_a_float_field() -> None:
    """float(10**400) raised OverflowError."""
    with pytest.raises(ConfigError, match=r"^train\.lr: 1{400} is too large for a number"):
        load_config(None, [*BASE, parse_override("train.lr=" + "1" * 400)])


@pytest.mark.parametrize("key", ["train.lr", "train.hidden_noise", "train.betas"])
def test_nan_is_refused(key: str) -> None:
    """train.lr: .nan passed every check (each comparison with NaN is false) into the run."""
    value = "[.nan, 0.95]" if key == "train.betas" else ".nan"
    with pytest.raises(ConfigError, match=rf"^{key}(\[0\])?: expected a number, found NaN"):
        load_config(None, [*BASE, parse_override(f"{key}={value}")])


def test_yaml_keys_that_are_not_strings(tmp_path: Path) -> None:
    """Unknown keys 1 and x: sorting them raised TypeError (int < str)."""
    path = tmp_path / "config.yaml"
    path.write_text("train: {1: 2, a: 3}\n")
    with pytest.raises(ConfigError, match=r"^train: unknown key\(s\) 1, a;"):
        load_config(path)


def test_integer_past_python_digit_limit() -> None:
    """PyYAML's int() raised ValueError (not a YAMLError) past 4300 digits."""
    with pytest.raises(ConfigError, match=r"^override 'data.num_workers=9{20}"):
        parse_override("data.num_workers=" + "9" * 5000)


def test_yaml_nested_past_the_parser(tmp_path: Path) -> None:
    """PyYAML's composer recursed into RecursionError on 1000 '['."""
    path = tmp_path / "config.yaml"
    path.write_text("a: " + "[" * 1000)
    with pytest.raises(ConfigError, match="not valid UTF-8 YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="value is not valid YAML"):
        parse_override("train.lr=" + "[" * 1000)


def test_config_file_not_utf8(tmp_path: Path) -> None:
    """read_text raised UnicodeDecodeError."""
    path = tmp_path / "config.yaml"
    path.write_bytes(b"train: {lr: \xff}\n")
    with pytest.raises(ConfigError, match=rf"^{path}: not valid UTF-8 YAML"):
        load_config(path)
