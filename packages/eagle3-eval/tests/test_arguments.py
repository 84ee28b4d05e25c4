"""Bad path arguments are refused before any work, with a message naming the argument, the path
and what was expected, and leave nothing behind."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

from eagle3_eval import offline, online, report
from eagle3_eval.cli import main

from support import fixtures
from support.refusal import refused_before_work_test

# The first step of real work in each command: reaching it fails the test.
FIRST_STEPS = [
    (offline, "run_offline"),
    (online, "prepare"),
    (report, "read_report"),
    # The package re-exports validate(), which hides the module of that name from dotted paths.
    (importlib.import_module("eagle3_schemas.contract.validate"), "validate"),
]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text("{}")  # enough for the path checks; never loaded here
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "notes.txt").write_text("")
    (tmp_path / "several" / "temperature-0").mkdir(parents=True)
    return {
        "target": target,
        "prompts": prompts,
        "draft": fixtures.build("draft_checkpoint", tmp_path),
        "ds": fixtures.build("hidden_states", tmp_path),
        "tok": fixtures.build("tokenized", tmp_path),
        "report": fixtures.build("eval_report", tmp_path),
    }


OFFLINE = "offline --draft {draft} --hidden-states {ds}"
REFERENCE = "reference --draft {draft} --target {target}"
# (argv with {placeholders}, the message expected on stderr, formatted the same way)
CASES = {
    "offline draft missing": (
        "offline --draft {tmp}/nope --hidden-states {ds} --out {tmp}/r",
        "--draft {tmp}/nope: does not exist; expected a draft checkpoint directory",
    ),
    "offline draft without config.json": (
        "offline --draft {tmp}/empty --hidden-states {ds} --out {tmp}/r",
        "--draft {tmp}/empty: has no config.json; expected a draft checkpoint directory",
    ),
    "offline hidden states is a file": (
        "offline --draft {draft} --hidden-states {tok} --out {tmp}/r",
        "--hidden-states {tok}: is a file, not a directory; expected a hidden_states artifact "
        "(a directory)",
    ),
    "offline hidden states of another kind": (
        "offline --draft {draft} --hidden-states {report} --out {tmp}/r",
        "--hidden-states {report}: is an eval_report artifact; expected a hidden_states artifact",
    ),
    "offline output exists": (
        OFFLINE + " --out {tmp}/empty",
        "--out {tmp}/empty: already exists; refusing to overwrite it; expected an eval_report "
        "artifact (a directory)",
    ),
    "offline output named like a file": (
        OFFLINE + " --out {tmp}/report.parquet",
        "--out {tmp}/report.parquet: names a .parquet file, but the output is a directory",
    ),
    "offline output parent is a file": (
        OFFLINE + " --out {tmp}/a_file/r",
        "--out {tmp}/a_file/r: cannot be created: {tmp}/a_file is a file, not a directory",
    ),
    "offline one of several temperatures exists": (
        OFFLINE + " --out {tmp}/several --temperature 0 --temperature 1",
        "--out {tmp}/several/temperature-0: already exists",
    ),
    "reference target without config.json": (
        "reference --draft {draft} --target {tmp}/empty --prompts {prompts} --out {tmp}/r",
        "--target {tmp}/empty: has no config.json; expected a target model directory",
    ),
    "reference prompts missing": (
        REFERENCE + " --prompts {tmp}/nope.jsonl --out {tmp}/r",
        "--prompts {tmp}/nope.jsonl: does not exist; expected a prompt file: MT-Bench "
        "question.jsonl, HumanEval .jsonl(.gz), GSM8K .jsonl, or conversations",
    ),
    "reference prompts of unknown type": (
        REFERENCE + " --prompts {tmp}/notes.txt --out {tmp}/r",
        "--prompts {tmp}/notes.txt: has the suffix '.txt'",
    ),
    "reference no samples per prompt": (
        REFERENCE + " --prompts {prompts} --out {tmp}/r --temperature 1 --samples 0",
        "--samples must be >= 1, got 0",
    ),
    "reference held-out sources missing": (
        REFERENCE + " --prompts {prompts} --heldout-sources {tmp}/nope.json --out {tmp}/r",
        "--heldout-sources {tmp}/nope.json: does not exist; expected a JSON file",
    ),
    "two drafts of one name": (
        "vllm --draft {draft} --draft {draft} --target {target} --prompts {prompts} --out {tmp}/r",
        "--draft names repeat (['draft', 'draft']): name each draft, --draft NAME=PATH",
    ),
    "a second draft's output exists": (
        "vllm --draft a={draft} --draft b={draft} --target {target} --prompts {prompts} "
        "--out {tmp}/several --temperature 0 --temperature 1",
        "--out {tmp}/several: already exists; refusing to overwrite it",
    ),
    "vllm python missing": (
        "vllm --draft {draft} --target {target} --prompts {prompts} --out {tmp}/r "
        "--vllm-python {tmp}/nope/python",
        "--vllm-python {tmp}/nope/python: is neither an executable file nor a command on PATH",
    ),
    "report missing": (
        "report {tmp}/nope",
        "REPORT {tmp}/nope: does not exist; expected an eval_report artifact (a directory)",
    ),
    "compare with another kind": (
        "compare {report} {ds}",
        "REPORT_B {ds}: is a hidden_states artifact; expected an eval_report artifact",
    ),
}


test_bad_argument_is_refused_before_any_work = refused_before_work_test(
    main, CASES, FIRST_STEPS, message_in="stderr"
)
