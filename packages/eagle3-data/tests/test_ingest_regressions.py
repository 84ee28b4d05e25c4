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
    return [json.loads(line) for line in rejects.read_text(encoding="utf-8").splitlines()]


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
