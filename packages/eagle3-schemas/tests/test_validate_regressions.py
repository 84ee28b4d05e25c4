"""Damage the fuzzed validation (test_fuzz_validate.py) found raising out of ``validate``, each
minimal: a list of violations naming the file now."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_schemas import validate
from eagle3_schemas.contract.artifact import Violation
from eagle3_schemas.contract.header import HEADER_KEY

from support.fixtures import build


def _assert_named(violations: list[Violation], file: str, message: str) -> None:
    """One of ``violations`` is of the file ``file`` and says ``message``."""
    assert any(v.file.endswith(file) and message in v.message for v in violations), violations


def test_json_file_that_is_a_directory(tmp_path: Path) -> None:
    """IsADirectoryError escaped _check_json (it caught only decoding errors)."""
    draft = build("draft_checkpoint", tmp_path)
    (draft / "config.json").unlink()
    (draft / "config.json").mkdir()
    _assert_named(validate(draft), "config.json", "not a readable UTF-8 JSON file")


def test_parquet_footer_that_is_not_utf8(tmp_path: Path) -> None:
    """A byte 0x80 written over a column name in the footer's schema: pyarrow's read_metadata
    raised UnicodeDecodeError out of read_header."""
    path = build("conversations", tmp_path)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"\x18\x08messages") + 2  # the thrift string of the column's name
    raw[at] = 0x80
    path.write_bytes(bytes(raw))
    [violation] = validate(path)
    assert violation.location == "(header)", violation


def test_parquet_header_value_that_is_not_utf8(tmp_path: Path) -> None:
    """A header value with invalid UTF-8: raw.decode raised out of read_header."""
    import pyarrow.parquet as pq

    path = build("conversations", tmp_path)
    table = pq.read_table(path)
    metadata = {**table.schema.metadata, HEADER_KEY.encode(): b"\xfb{}"}
    pq.write_table(table.replace_schema_metadata(metadata), path)
    [violation] = validate(path)
    assert violation.location == "(header)" and "UTF-8" in violation.message, violation


def test_draft_config_whose_layer_config_is_null(tmp_path: Path) -> None:
    """transformer_layer_config: null made symbols_from_header raise AttributeError."""
    draft = build("draft_checkpoint", tmp_path)
    config = json.loads((draft / "config.json").read_text())
    config["transformer_layer_config"] = None
    (draft / "config.json").write_text(json.dumps(config))
    violations = validate(draft)
    assert any(v.location == "(symbols)" and "AttributeError" in v.message for v in violations), (
        violations
    )


def test_data_parquet_footer_that_is_not_utf8(tmp_path: Path) -> None:
    """Found at 10,000 examples: the same damage in a Parquet file that holds no header (an
    eval report's samples.parquet) raised UnicodeDecodeError out of _check_parquet."""
    report = build("eval_report", tmp_path)
    samples = report / "samples.parquet"
    raw = bytearray(samples.read_bytes())
    name = b"\x18\x09sample_id"
    raw[raw.index(name) + 2] = 0x80  # the first byte of a column's name in the footer
    samples.write_bytes(bytes(raw))
    _assert_named(validate(report), "samples.parquet", "not a readable Parquet file")


def test_header_schema_version_true_or_float(tmp_path: Path) -> None:
    """Found at 10,000 examples: schema_version true (== 1 in Python) passed the version check
    and load_schema looked for vTrue.json (FileNotFoundError); 1.0 for v1.0.json."""
    from support.edits import rewrite_header

    for value in (True, 1.0):
        path = build("tokenized", tmp_path / str(value))
        rewrite_header(path, lambda h, v=value: h.update(schema_version=v))
        [violation] = validate(path)
        assert violation.location == "header.schema_version", violation
