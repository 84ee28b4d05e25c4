"""Bad path arguments are refused before any work (no accelerator, no tracker, no output
directory), with a message naming the argument, the path and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_train.cli import main
from eagle3_train.run import trainer

from support import fixtures
from support.refusal import refused_before_work_test
from support.train import Inputs, write_config

# The first step of real work: reaching it fails the test.
FIRST_STEPS = [(trainer, "train")]


@pytest.fixture
def files(tmp_path: Path, inputs: Inputs) -> dict[str, Path]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "config.json").write_text("{}")
    return {
        "config": write_config(inputs, tmp_path / "run"),
        "hs": inputs.hidden_states,
        "vm": inputs.vocab_map,
        "tok": fixtures.build("tokenized", tmp_path),
    }


# (argv with {placeholders}, the message expected on stderr, formatted the same way)
CASES = {
    "config missing": (
        "--config {tmp}/nope.yaml",
        "--config {tmp}/nope.yaml: does not exist; expected a YAML config file",
    ),
    "config is a directory": (
        "--config {tmp}/empty",
        "--config {tmp}/empty: is a directory, not a file; expected a YAML config file",
    ),
    "config of another type": (
        "--config {tmp}/config.json",
        "--config {tmp}/config.json: has the suffix '.json'; expected a YAML config file",
    ),
    "hidden states missing": (
        "--config {config} --set data.hidden_states={tmp}/nope",
        "data.hidden_states {tmp}/nope: does not exist; expected a hidden_states artifact "
        "(a directory)",
    ),
    "hidden states is a file": (
        "--config {config} --set data.hidden_states={vm}",
        "data.hidden_states {vm}: is a file, not a directory",
    ),
    "vocab map of another type": (
        "--config {config} --set data.vocab_map={tok}",
        "data.vocab_map {tok}: has the suffix '.parquet'; expected a vocab_map artifact "
        "(a .safetensors file)",
    ),
    "target without config.json": (
        "--config {config} --set target.path={tmp}/empty",
        "target.path {tmp}/empty: has no config.json; expected a target model directory",
    ),
    "resume from no checkpoint": (
        "--config {config} --resume {tmp}/empty",
        "train.resume {tmp}/empty: has no trainer_state.json; expected a checkpoint directory",
    ),
    "output dir is a file": (
        "--config {config} --output-dir {tmp}/a_file",
        "--output-dir {tmp}/a_file: exists and is a file, not a directory; expected a directory "
        "of its own for the run",
    ),
    "output dir is another stage's artifact": (
        "--config {config} --output-dir {hs}",
        "--output-dir {hs}: is a hidden_states artifact; expected a directory of its own",
    ),
    "output dir from the config cannot be created": (
        "--config {config} --set output_dir={tmp}/a_file/run",
        "output_dir {tmp}/a_file/run: cannot be created: {tmp}/a_file is a file, not a directory",
    ),
    "fc_norm with norm_before_fc": (
        "--config {config} --set draft.fc_norm=true --set draft.norm_before_fc=true",
        "draft.fc_norm and draft.norm_before_fc: two norms of fc's input, choose one",
    ),
}


test_bad_argument_is_refused_before_any_work = refused_before_work_test(
    main, CASES, FIRST_STEPS, message_in="stderr"
)
