"""Bad path arguments are refused before any work, with a message naming the argument, the path
and what was expected, and leave nothing behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_extract import merge, run, verify
from eagle3_extract.cli import main

from support import fixtures
from support.refusal import refused_before_work_test

# The first step of real work in each command: reaching it fails the test.
FIRST_STEPS = [(run, "resolve"), (merge, "check_inputs"), (verify, "validate")]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # enough for the path checks; never loaded here
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "empty.json").mkdir()
    return {
        "model": model,
        "tok": fixtures.build("tokenized", tmp_path),
        "conv": fixtures.build("conversations", tmp_path),
        "ds": fixtures.build("hidden_states", tmp_path),
    }


RUN = "run --model {model} --tokenized {tok}"
# (argv with {placeholders}, the message expected in the log, formatted the same way)
CASES = {
    "run tokenized missing": (
        "run --model {model} --tokenized {tmp}/nope.parquet --out {tmp}/ds2",
        "--tokenized {tmp}/nope.parquet: does not exist; expected a tokenized artifact "
        "(a .parquet file)",
    ),
    "run tokenized of another kind": (
        "run --model {model} --tokenized {conv} --out {tmp}/ds2",
        "--tokenized {conv}: is a conversations artifact; expected a tokenized artifact",
    ),
    "run model without config.json": (
        "run --model {tmp}/empty --tokenized {tok} --out {tmp}/ds2",
        "--model {tmp}/empty: has no config.json; expected a target model directory",
    ),
    "run model is a file": (
        "run --model {tmp}/a_file --tokenized {tok} --out {tmp}/ds2",
        "--model {tmp}/a_file: is a file, not a directory",
    ),
    "run tokenizer missing": (
        RUN + " --tokenizer {tmp}/nope --out {tmp}/ds2",
        "--tokenizer {tmp}/nope: does not exist; expected a tokenizer directory",
    ),
    "run output named like a file": (
        RUN + " --out {tmp}/hidden.safetensors",
        "--out {tmp}/hidden.safetensors: names a .safetensors file, but the output is a "
        "directory; expected a hidden_states artifact (a directory)",
    ),
    "run output is someone else's directory": (
        RUN + " --out {tmp}/empty",
        "--out {tmp}/empty: exists and is not a complete hidden-state dataset (no dataset.json); "
        "expected a hidden_states artifact (a directory) not there yet; a killed run resumes "
        "from {tmp}/empty.partial",
    ),
    "run output is a file": (
        RUN + " --out {tmp}/a_file",
        "--out {tmp}/a_file: exists and is a file, not a directory",
    ),
    "run output parent is a file": (
        RUN + " --out {tmp}/a_file/ds",
        "--out {tmp}/a_file/ds: cannot be created: {tmp}/a_file is a file, not a directory",
    ),
    "run seed without a sample count": (
        RUN + " --out {tmp}/ds2 --sample-seed 0",
        "sample_seed draws a random max_samples rows: set max_samples too",
    ),
    "preflight output named like a file": (
        "preflight --model {model} --tokenized {tok} --out {tmp}/ds.parquet",
        "--out {tmp}/ds.parquet: names a .parquet file",
    ),
    "merge output exists": (
        "merge --out {ds} {ds}",
        "--out {ds}: already exists; refusing to overwrite it",
    ),
    "merge input missing": (
        "merge --out {tmp}/merged {ds} {tmp}/rank1",
        "input {tmp}/rank1: does not exist; expected a hidden_states artifact (a directory)",
    ),
    "merge input is a file": (
        "merge --out {tmp}/merged {tok}",
        "input {tok}: is a file, not a directory; expected a hidden_states artifact",
    ),
    "verify dataset missing": (
        "verify {tmp}/nope --model {model}",
        "dataset {tmp}/nope: does not exist; expected a hidden_states artifact",
    ),
    "verify json report with another suffix": (
        "verify {ds} --model {model} --json {tmp}/report.txt",
        "--json {tmp}/report.txt: does not end in .json; expected a JSON report file",
    ),
    "verify json report is a directory": (
        "verify {ds} --model {model} --json {tmp}/empty.json",
        "--json {tmp}/empty.json: exists and is a directory, not a file",
    ),
}


test_bad_argument_is_refused_before_any_work = refused_before_work_test(
    main, CASES, FIRST_STEPS, message_in="log"
)
