"""Preflight refuses mismatched inputs in seconds, naming both sides."""

from __future__ import annotations

import json
import time

import pytest

from eagle3_schemas.safetensors_format import read_safetensors
from eagle3_train.config import load_config
from eagle3_train.inputs import load_inputs, resolve_arch
from eagle3_train.preflight import run_preflight
from eagle3_train.synthetic import fake_fingerprint, write_vocab_map_from_counts
from eagle3_train.testing import make_inputs, run_cli, write_config


def _errors(inputs, tmp_path, **sections):
    config = load_config(write_config(inputs, tmp_path / "run", **sections))
    run = load_inputs(config)
    report = run_preflight(run, resolve_arch(run), None, None, full=True)
    return [str(f) for f in report.errors], report


def test_clean_inputs_pass_every_check_and_run_one_batch(inputs, tmp_path):
    errors, report = _errors(inputs, tmp_path)
    assert errors == []
    checks = {f.check for f in report.findings if f.level == "ok"}
    assert {"schema", "lineage", "interfaces", "dry_run", "memory"} <= checks


def test_wrong_layer_ids_dataset_is_refused(tmp_path):
    wrong = make_inputs(tmp_path / "wrong", aux_layer_ids=(0, 2, 4))
    errors, _ = _errors(wrong, tmp_path)  # config expects [1, 2, 3]
    assert len(errors) == 1, errors
    assert "dataset.json has aux_layer_ids [0, 2, 4]" in errors[0]
    assert "draft.aux_layer_ids expects [1, 2, 3]" in errors[0]


def test_foreign_vocab_map_is_refused(tmp_path):
    foreign = make_inputs(tmp_path / "foreign", vocab_label="other-tokenizer")
    errors, _ = _errors(foreign, tmp_path)
    joined = "\n".join(errors)
    assert "lineage tokenizer_fingerprint: vocab map" in joined
    assert str(foreign.vocab_map) in joined and "dataset.json" in joined
    assert "foreign vocab map" in joined


def test_vocab_map_of_another_tokenized_dataset_with_the_same_tokenizer_is_refused(
    inputs, tmp_path
):
    """Only the tokenized-dataset lineage differs: same tokenizer, same counts, same shapes.

    A vocab map counted over another tokenized set (say, before the answers were regenerated)
    passes every shape check; the lineage comparison is the only thing that can refuse it.
    """
    ds_lineage = json.loads((inputs.hidden_states / "dataset.json").read_text())["lineage"]
    vm = read_safetensors(inputs.vocab_map)
    counts = vm.array("token_counts")
    other_set = fake_fingerprint("another-tokenized-dataset/tokenized")
    write_vocab_map_from_counts(
        inputs.vocab_map,
        counts,
        vm.tensors["d2t"].shape[0],
        {
            "tokenizer_fingerprint": ds_lineage["tokenizer_fingerprint"],
            "tokenized_fingerprint": other_set,
        },
    )
    errors, _ = _errors(inputs, tmp_path)
    assert len(errors) == 1, errors
    assert "lineage tokenized_fingerprint: vocab map" in errors[0]
    assert f"{other_set!r}" in errors[0] and f"{ds_lineage['tokenized_fingerprint']!r}" in errors[0]
    assert str(inputs.vocab_map) in errors[0] and "dataset.json" in errors[0]
    assert "the vocab map was counted over another tokenized dataset" in errors[0]


def test_mismatched_hidden_size_is_refused(tmp_path):
    mismatched = make_inputs(tmp_path / "h", hidden=16, target_hidden=32)
    errors, _ = _errors(mismatched, tmp_path)
    assert any(
        "hidden_size: target config" in e and "has 32" in e and "target.hidden_size has 16" in e
        for e in errors
    ), errors


def test_cli_preflight_stops_in_seconds_with_both_sides(tmp_path):
    wrong = make_inputs(tmp_path / "wrong", aux_layer_ids=(0, 2, 4))
    config = write_config(wrong, tmp_path / "run")
    start = time.perf_counter()
    result = run_cli(["--config", str(config), "--preflight"])
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr[-2000:]
    assert "[0, 2, 4]" in result.stderr and "[1, 2, 3]" in result.stderr
    assert elapsed < 60  # process start-up included; the checks themselves take < 1 s
    assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"train": {"lrr": 1}}, "unknown key(s) lrr"),
        ({"train": {"ttt_steps": "three"}}, "train.ttt_steps: expected an integer, found 'three'"),
        ({"draft": {"attention": "flash"}}, "draft.attention: 'flash' is not one of"),
    ],
)
def test_config_errors_name_the_key(inputs, tmp_path, override, message):
    from eagle3_train.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(write_config(inputs, tmp_path / "run", **override))
    assert message in str(e.value)


def test_cli_overrides_win_over_the_file(inputs, tmp_path):
    from eagle3_train.config import parse_override

    path = write_config(inputs, tmp_path / "run", train={"lr": 0.1})
    config = load_config(
        path, [parse_override("train.lr=3e-4"), parse_override("draft.num_layers=2")]
    )
    assert config.train.lr == 3e-4 and config.draft.num_layers == 2
    assert config.train.ttt_steps == 3  # defaults below the file
