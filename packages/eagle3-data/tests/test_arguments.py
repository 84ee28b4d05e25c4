"""Bad path arguments are refused before any work, with a message naming the argument, the
path and what was expected, and leave nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_data import ingest, regenerate, tokenization, vocab
from eagle3_data.cli import main
from eagle3_schemas.contract.validate import Violation

from support import fixtures
from support.refusal import refused_before_work_test

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


# The first step of real work in each command: reaching it fails the test.
FIRST_STEPS = [
    (ingest, "records"),
    (regenerate, "_conversations"),
    (tokenization, "load_tokenizer"),
    (vocab, "count_loss_tokens"),
]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "a_file").write_text("not a directory")
    (tmp_path / "plain_dir").mkdir()
    (tmp_path / "notes.txt").write_text("not chat data")
    (tmp_path / "existing.parquet").write_text("")
    return {
        "raw": raw,
        "conv": fixtures.build("conversations", tmp_path),
        "tok": fixtures.build("tokenized", tmp_path),
        "tokenizer": tmp_path / "plain_dir",
    }


# (argv with {placeholders}, the message expected on stderr, formatted the same way)
CASES = {
    "ingest output without .parquet": (
        "ingest {raw} --out {tmp}/data/conversations",
        "--out {tmp}/data/conversations: does not end in .parquet (e.g. "
        "{tmp}/data/conversations.parquet); expected a conversations artifact (a .parquet file)",
    ),
    "ingest output exists": (
        "ingest {raw} --out {tmp}/existing.parquet",
        "--out {tmp}/existing.parquet: already exists; refusing to overwrite it",
    ),
    "ingest output parent is a file": (
        "ingest {raw} --out {tmp}/a_file/c.parquet",
        "--out {tmp}/a_file/c.parquet: cannot be created: {tmp}/a_file is a file, not a directory",
    ),
    "ingest input missing": (
        "ingest {raw} {tmp}/missing.jsonl --out {tmp}/c.parquet",
        "input {tmp}/missing.jsonl: does not exist; expected a .jsonl, .json or .parquet file, "
        "or a datasets directory (save_to_disk)",
    ),
    "ingest input of unknown type": (
        "ingest {tmp}/notes.txt --out {tmp}/c.parquet",
        "input {tmp}/notes.txt: has the suffix '.txt'; expected a .jsonl",
    ),
    "ingest input directory that is no dataset": (
        "ingest {tmp}/plain_dir --out {tmp}/c.parquet",
        "input {tmp}/plain_dir: is a directory without state.json or dataset_dict.json",
    ),
    "ingest rejects is a directory": (
        "ingest {raw} --out {tmp}/c.parquet --rejects {tmp}/plain_dir",
        "--rejects {tmp}/plain_dir: exists and is a directory, not a file",
    ),
    "tokenize input is a directory": (
        "tokenize {tmp}/plain_dir --tokenizer {tokenizer} --out {tmp}/t.parquet",
        "conversations {tmp}/plain_dir: is a directory, not a file; "
        "expected a conversations artifact (a .parquet file)",
    ),
    "tokenize input of another kind": (
        "tokenize {tok} --tokenizer {tokenizer} --out {tmp}/t.parquet",
        "conversations {tok}: is a tokenized artifact; expected a conversations artifact",
    ),
    "tokenize tokenizer missing": (
        "tokenize {conv} --tokenizer {tmp}/nope --out {tmp}/t.parquet",
        "--tokenizer {tmp}/nope: does not exist; expected a Hugging Face tokenizer or model "
        "directory",
    ),
    "tokenize output with another suffix": (
        "tokenize {conv} --tokenizer {tokenizer} --out {tmp}/t.safetensors",
        "--out {tmp}/t.safetensors: does not end in .parquet; expected a tokenized artifact",
    ),
    "vocab output with another suffix": (
        "vocab {tok} --draft-vocab-size 4 --out {tmp}/vocab.parquet",
        "--out {tmp}/vocab.parquet: does not end in .safetensors; expected a vocab_map artifact "
        "(a .safetensors file)",
    ),
    "vocab input missing": (
        "vocab {tmp}/t.parquet --draft-vocab-size 4 --out {tmp}/v.safetensors",
        "tokenized {tmp}/t.parquet: does not exist; expected a tokenized artifact (a .parquet file)",
    ),
    "regenerate input missing": (
        "regenerate {tmp}/c.parquet --endpoint http://127.0.0.1:9/v1 --model m --out {tmp}/r.parquet",
        "conversations {tmp}/c.parquet: does not exist; expected a conversations artifact",
    ),
    "regenerate output exists": (
        "regenerate {conv} --endpoint http://127.0.0.1:9/v1 --model m --out {conv}",
        "--out {conv}: already exists; refusing to overwrite it",
    ),
}


test_bad_argument_is_refused_before_any_work = refused_before_work_test(
    main, CASES, FIRST_STEPS, message_in="stderr"
)


def test_output_that_fails_its_schema_leaves_the_artifact_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tmp_path / "raw.jsonl"
    raw.write_text(json.dumps(GOOD) + "\n")
    out = tmp_path / "c.parquet"
    broken = [Violation(str(out), "header", "made up for the test")]
    monkeypatch.setattr("eagle3_data.cli.validate", lambda path: broken)
    assert main(["ingest", str(raw), "--out", str(out)]) == 1
    assert not out.exists() and (tmp_path / "c.parquet.invalid").is_file()
    assert f"moved to {out}.invalid" in capsys.readouterr().err


def test_a_command_failing_mid_work_leaves_no_file_under_the_output_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = tmp_path / "raw.jsonl"
    raw.write_text("\n".join(json.dumps(GOOD | {"n": i}) for i in range(5)) + "\n")
    calls = {"n": 0}
    real = ingest.normalise

    def crash_on_the_third(record: object) -> object:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated crash mid-stream")
        return real(record)

    monkeypatch.setattr(ingest, "normalise", crash_on_the_third)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        main(
            [
                "ingest",
                str(raw),
                "--out",
                str(tmp_path / "c.parquet"),
                "--rejects",
                str(tmp_path / "r.jsonl"),
            ]
        )
    # The stream and the rejects file were written under temporary names, removed on failure.
    assert sorted(tmp_path.rglob("*")) == before
