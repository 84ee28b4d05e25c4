"""ingest reads every supported layout, keeps each valid record once, and explains every reject."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_data.cli import main
from eagle3_data.config import IngestConfig
from eagle3_data.ingest import run
from eagle3_schemas import PathArgumentError, read_header, validate
from eagle3_schemas.layouts.conversations import conversation_id, iter_rows

GOOD_SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "Sort a list."},
        {"from": "gpt", "value": "sorted(xs)"},
    ]
}
GOOD_OPENAI = {
    "messages": [
        {"role": "system", "content": "Answer in Python."},
        {"role": "user", "content": "Reverse a string."},
        {"role": "assistant", "content": "s[::-1]"},
        {"role": "user", "content": "And uppercase it?"},
        {"role": "assistant", "content": [{"type": "text", "text": "s[::-1].upper()"}]},
    ]
}
# (raw line, expected reject class) — every one must reach the rejects file with its reason
DIRTY = [
    (b'{"messages": [{"role": "user", "content": "hi"}', "bad_json"),
    (
        b'{"messages": [{"role": "user", "content": "caf\xe9"}, {"role": "assistant", "content": "ok"}]}',
        "non_utf8",
    ),
    (
        json.dumps(
            {
                "messages": [
                    {"role": "wizard", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ]
            }
        ).encode(),
        "unknown_role",
    ),
    (
        json.dumps(
            {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]}
        ).encode(),
        "empty_turn",
    ),
    (
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": "b"},
                    {"role": "assistant", "content": "c"},
                ]
            }
        ).encode(),
        "not_alternating",
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}).encode(),
        "no_assistant",
    ),
    (json.dumps({"text": "no conversation here"}).encode(), "unknown_format"),
    (b"[1, 2, 3]", "unknown_format"),
]


def _write_dirty_jsonl(path: Path) -> None:
    lines = [
        json.dumps(GOOD_OPENAI).encode(),
        *(raw for raw, _ in DIRTY),
        json.dumps(GOOD_OPENAI).encode(),
        b"",
    ]
    path.write_bytes(b"\n".join(lines))


def test_dirty_jsonl_every_reject_explained_nothing_valid_lost(tmp_path: Path) -> None:
    raw = tmp_path / "dirty.jsonl"
    _write_dirty_jsonl(raw)
    out, rejects = tmp_path / "conv.parquet", tmp_path / "rejects.jsonl"
    summary = run(IngestConfig([raw], out, rejects))
    assert validate(out) == []
    assert summary.read == len(DIRTY) + 2 and summary.written == 1 and summary.duplicates == 1
    rejected = [json.loads(line) for line in rejects.read_text().splitlines()]
    assert [r["reason"].split(":")[0] for r in rejected] == [cls for _, cls in DIRTY]
    assert [r["source"] for r in rejected] == [f"dirty.jsonl:{n}" for n in range(2, 2 + len(DIRTY))]
    assert all(r["record"] for r in rejected)  # the raw record is kept, not just the reason
    assert "caf\\xe9" in rejected[1]["record"]
    header = read_header(out)
    assert header.fields["num_rejected"] == len(DIRTY)
    table = list(iter_rows(out))
    assert table[0]["messages"][4] == {"role": "assistant", "content": "s[::-1].upper()"}
    assert table[0]["id"] == conversation_id(table[0]["messages"])


def test_sharegpt_json_array_parquet_and_datasets_dir(tmp_path: Path) -> None:
    from datasets import Dataset

    array = tmp_path / "share.json"
    array.write_text(
        json.dumps([GOOD_SHAREGPT, {"conversations": [{"from": "gpt", "value": "first"}]}])
    )
    parquet = tmp_path / "msgs.parquet"
    pq.write_table(pa.Table.from_pylist([{"messages": GOOD_OPENAI["messages"][:3]}]), parquet)
    saved = tmp_path / "hf"
    other = {
        "messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}]
    }
    Dataset.from_list([other]).save_to_disk(str(saved))
    out = tmp_path / "conv.parquet"
    summary = run(IngestConfig([array, parquet, saved], out, tmp_path / "rej.jsonl"))
    assert validate(out) == []
    assert summary.written == 3 and sum(summary.rejected.values()) == 1
    rows = list(iter_rows(out))
    assert [r["source"] for r in rows] == ["share.json:0", "msgs.parquet:0", "hf:0"]
    assert rows[0]["messages"] == [
        {"role": "user", "content": "Sort a list."},
        {"role": "assistant", "content": "sorted(xs)"},
    ]


def test_json_array_streams_records_across_read_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import eagle3_data.raw_records as raw_records

    monkeypatch.setattr(raw_records, "JSON_CHUNK_CHARS", 7)  # every record spans many reads
    records = [
        {
            "messages": [
                {"role": "user", "content": f"q{i} ✓"},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i in range(20)
    ]
    path = tmp_path / "many.json"
    path.write_text(json.dumps(records, ensure_ascii=False, indent=1))
    summary = run(IngestConfig([path], tmp_path / "c.parquet", tmp_path / "r.jsonl"))
    assert summary.written == 20 and not summary.rejected


def test_refuses_to_overwrite_and_cli_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = tmp_path / "dirty.jsonl"
    _write_dirty_jsonl(raw)
    out = tmp_path / "conv.parquet"
    assert main(["ingest", str(raw), "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["written"] == 1 and (tmp_path / "conv.parquet.rejects.jsonl").is_file()
    with pytest.raises(PathArgumentError, match="already exists"):
        run(IngestConfig([raw], out, tmp_path / "r.jsonl"))
    assert main(["ingest", str(raw), "--out", str(out)]) == 2


def test_keep_selects_records_by_field(tmp_path: Path) -> None:
    raw = tmp_path / "corpus.jsonl"
    records = [{**GOOD_SHAREGPT, "split": "train"}, {**GOOD_OPENAI, "split": "heldout"}]
    raw.write_text("\n".join(json.dumps(r) for r in records))
    summary = run(
        IngestConfig(
            [raw], tmp_path / "c.parquet", tmp_path / "r.jsonl", keep={"split": ("heldout",)}
        )
    )
    assert (summary.written, summary.skipped) == (1, 1)
    assert pq.read_table(tmp_path / "c.parquet").column("source").to_pylist() == ["corpus.jsonl:2"]
    assert read_header(tmp_path / "c.parquet").fields["keep"] == {"split": ["heldout"]}


def test_keep_repeated_for_one_field_keeps_any_of_its_values(tmp_path: Path, capsys) -> None:
    """--keep kind=thinking --keep kind=agent keeps both kinds (it once kept the last alone);
    fields named apart must all match."""
    raw = tmp_path / "corpus.jsonl"
    kinds = ["instant", "thinking", "agent", "thinking"]
    splits = ["train", "train", "train", "heldout"]
    records = [
        {"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "A"}],
         "kind": kind, "split": split}
        for i, (kind, split) in enumerate(zip(kinds, splits, strict=True))
    ]  # fmt: skip
    raw.write_text("\n".join(json.dumps(r) for r in records))
    out = tmp_path / "c.parquet"
    argv = [
        "ingest",
        str(raw),
        "--out",
        str(out),
        "--keep",
        "kind=thinking",
        "--keep",
        "kind=agent",
    ]
    assert main([*argv, "--keep", "split=train"]) == 0
    assert pq.read_table(out).column("source").to_pylist() == ["corpus.jsonl:2", "corpus.jsonl:3"]
    assert read_header(out).fields["keep"] == {"kind": ["thinking", "agent"], "split": ["train"]}
