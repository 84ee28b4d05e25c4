"""Inputs the fuzzed ingest (test_fuzz_ingest.py) found crashing it, each minimal: refused by name
now, the run finished and its output whole."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_data.config import IngestConfig
from eagle3_data.ingest import run
from eagle3_schemas import validate


def _ingest(tmp_path: Path, raw: Path) -> list[dict]:
    """Run ingest on ``raw``; the output validates; the rejects, parsed."""
    out, rejects = tmp_path / "conv.parquet", tmp_path / "rejects.jsonl"
    run(IngestConfig([raw], out, rejects))
    assert validate(out) == []
    return [json.loads(line) for line in rejects.read_bytes().splitlines()]


def test_content_part_whose_text_is_not_text(tmp_path: Path) -> None:
    raw = tmp_path / "raw.jsonl"
    turns = [
        {"role": "user", "content": [{"type": "text", "text": None}, {"type": "text", "text": 5}]},
        {"role": "assistant", "content": "ok"},
    ]
    raw.write_text(json.dumps({"messages": turns}) + "\n")
    [reject] = _ingest(tmp_path, raw)
    assert reject["source"] == "raw.jsonl:1"
    assert reject["reason"].startswith("unknown_format: turn 0: field content:")


def test_lone_surrogate_escape_in_jsonl_and_json_array(tmp_path: Path) -> None:
    """json reads "\\ud800" as a str no UTF-8 file can hold: the Parquet and rejects writers
    raised UnicodeEncodeError. Refused before either, naming the field."""
    line = '{"messages": [{"role": "user", "content": "a\\ud800"}, {"role": "assistant", "content": "b"}]}'
    paired = '{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}, {"role": "assistant", "content": "b"}]}'
    jsonl, array = tmp_path / "raw.jsonl", tmp_path / "raw.json"
    jsonl.write_text(line + "\n" + paired + "\n")
    array.write_text(f"[{line}, {paired}]")
    for raw, source in ((jsonl, "raw.jsonl:1"), (array, "raw.json:0")):
        [reject] = _ingest(tmp_path / raw.suffix[1:], raw)  # the emoji pair is written
        assert reject["source"] == source
        assert reject["reason"].startswith("non_utf8: field messages[0].content:")
        assert reject["record"] == line  # kept as the source's text, escape and all


def test_json_nested_deeper_than_the_reader(tmp_path: Path) -> None:
    """A line of 100,000 '[' raised RecursionError out of json.loads."""
    raw = tmp_path / "raw.jsonl"
    raw.write_text("[" * 100_000 + "\n")
    [reject] = _ingest(tmp_path, raw)
    assert reject["source"] == "raw.jsonl:1"
    assert reject["reason"].startswith("bad_json: the record nests deeper")


def test_integer_longer_than_the_digit_limit(tmp_path: Path) -> None:
    """json.loads raises a plain ValueError (not JSONDecodeError) past 4300 digits."""
    for name, text in (("raw.jsonl", '{"messages": %s}\n'), ("raw.json", '[{"messages": %s}]')):
        raw = tmp_path / name
        raw.write_text(text % ("1" * 5000))
        [reject] = _ingest(tmp_path / raw.suffix[1:], raw)
        assert reject["reason"].startswith("bad_json: a number in the record is too long"), reject
        assert "4300 digits" in reject["reason"]


def test_refused_table_row_with_a_binary_column(tmp_path: Path) -> None:
    """A Parquet row refused beside a binary column (an image, say) crashed the rejects file:
    bytes are not JSON. The row is kept with its bytes written as Python shows them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"tools": ["[]"], "blob": pa.array([b"\x00"], pa.binary())}), raw)
    [reject] = _ingest(tmp_path, raw)
    assert reject["source"] == "raw.parquet:0"
    assert reject["reason"].startswith("unknown_format:")
    assert reject["record"] == {"tools": "[]", "blob": "b'\\x00'"}


def test_damaged_parquet_file(tmp_path: Path) -> None:
    """One byte after a Parquet file's footer: pyarrow raised ArrowInvalid out of ingest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = tmp_path / "raw.parquet"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    pq.write_table(pa.Table.from_pylist([{"messages": turns}]), raw)
    raw.write_bytes(raw.read_bytes() + b"\x00")
    [reject] = _ingest(tmp_path, raw)
    assert reject["source"] == "raw.parquet:0"
    assert reject["reason"].startswith("unreadable: raw.parquet (Parquet) cannot be read")


def test_datasets_directory_datasets_cannot_load(tmp_path: Path) -> None:
    """A saved dataset of one row and no column: load_from_disk raises IndexError."""
    import pyarrow as pa
    from datasets import Dataset

    raw = tmp_path / "raw"
    Dataset(pa.Table.from_pylist([{}])).save_to_disk(str(raw))
    [reject] = _ingest(tmp_path, raw)
    assert reject["source"] == "raw:0"
    assert reject["reason"].startswith("unreadable: raw (a datasets directory) cannot be read")
