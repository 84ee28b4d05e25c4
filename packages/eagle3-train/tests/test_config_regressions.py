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


FLOAT_KEYS = [
    "train.lr",
    "train.min_lr_ratio",
    "train.weight_decay",
    "train.adam_eps",
    "train.max_grad_norm",
    "train.hidden_noise",
    "train.ttt_step_loss_decay",
    "train.collective_timeout_s",
    "train.muon.lr",
    "train.muon.momentum",
    "train.muon.weight_decay",
    "train.muon.adamw_weight_decay",
    "train.objective.topk_weight",
    "train.objective.lk_eta",
    "data.validation_fraction",
    "data.stream_timeout_s",
    "target.rms_norm_eps",
    "draft.rms_norm_eps",
    "draft.rope_theta",
]


@pytest.mark.parametrize("sign", ["", "-"])
@pytest.mark.parametrize("key", [*FLOAT_KEYS, "train.betas"])
def test_infinity_is_refused(key: str, sign: str) -> None:
    """train.lr=inf passed "> 0" (and -inf every ">= 0" it was never compared with) into
    the run; every float field now refuses both, naming the key."""
    value = f"[{sign}.inf, 0.95]" if key == "train.betas" else f"{sign}.inf"
    with pytest.raises(
        ConfigError, match=rf"^{key}(\[0\])?: expected a finite number, found {sign}inf$"
    ):
        load_config(None, [*BASE, parse_override(f"{key}={value}")])


def test_infinity_in_a_yaml_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("data: {hidden_states: hs, vocab_map: v.safetensors}\ntrain: {lr: .inf}\n")
    with pytest.raises(ConfigError, match=r"^train\.lr: expected a finite number, found inf$"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.betas=[0.9, 1.0]", r"train\.betas: \[0\.9, 1\.0\] must each be in \[0, 1\)"),
        ("train.betas=[-0.1, 0.9]", r"train\.betas: \[-0\.1, 0\.9\] must each be in \[0, 1\)"),
        ("train.weight_decay=-0.1", r"train\.weight_decay: -0\.1 must be >= 0"),
        ("train.adam_eps=0", r"train\.adam_eps: 0\.0 must be > 0"),
        ("train.max_grad_norm=-1", r"train\.max_grad_norm: -1\.0 must be >= 0"),
        ("train.warmup_steps=-5", r"train\.warmup_steps: -5 must be >= 0"),
        ("train.muon.momentum=1.0", r"train\.muon\.momentum: 1\.0 must be in \[0, 1\)"),
        ("target.rms_norm_eps=0", r"target\.rms_norm_eps: 0\.0 must be > 0"),
        ("draft.rms_norm_eps=-1e-6", r"draft\.rms_norm_eps: -1e-06 must be > 0"),
        ("draft.rope_theta=0", r"draft\.rope_theta: 0\.0 must be > 0"),
    ],
)
def test_finite_floats_out_of_range_are_refused(override: str, message: str) -> None:
    """Betas of 1 or more, a negative weight decay or clip norm, eps 0: each reached the
    optimizer (a loss that never moves, or grows) instead of a refusal naming the key."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, parse_override(override)])


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
