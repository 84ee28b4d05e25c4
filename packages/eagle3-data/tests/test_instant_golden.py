"""Instant, tool-free conversations ingest and tokenize byte for byte as before conversations v2
(issue 42): the digests below were computed on the code before v2 existed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_data import ingest, tokenization
from eagle3_data.config import IngestConfig, TokenizeConfig
from eagle3_schemas.layouts.conversations import read_messages

RECORDS = [
    {
        "messages": [
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "    return a + b"},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Add?"},
            {"role": "assistant", "content": "<think>\nsum them\n</think>\n\n1+1=2"},
            {"role": "user", "content": "Mul?"},
            {"role": "assistant", "content": "2*2=4"},
        ]
    },
    {
        "conversations": [
            {"from": "human", "value": "Name a sort."},
            {"from": "gpt", "value": "sorted(xs)"},
            {"from": "human", "value": "Why sorted(xs)?"},
            {"from": "gpt", "value": "sorted(xs) is stable."},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
            },
            {"role": "assistant", "content": "Hello! 😀 ünïcode"},
        ]
    },
]

# sha256 of the canonical JSON of the conversations' (id, messages) and the tokenized
# (id, input_ids, loss_mask) columns, before conversations v2.
GOLDEN = {
    "conversations": "02a5061435f4c0064ec04105eea051ea854117642568237350a4ed603bc628b0",
    "tiny": "0b4e735b40847305f7ba9545ef632c09167104914d25eba0d93d928c37cb0716",
    "qwen3": "1ad9330d1bc347ffa9fc06dc9c22d8a901741556d9158ac0799d4a36c6906453",
}


def _digest(path: Path, columns: list[str]) -> str:
    table = pq.read_table(path, columns=columns).to_pydict()
    if "messages" in table:  # the turns as readers see them (v2 adds null fields to the type)
        table["messages"] = [read_messages(m) for m in table["messages"]]
    return hashlib.sha256(json.dumps(table, sort_keys=True).encode()).hexdigest()


@pytest.fixture(scope="module")
def conversations(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("golden")
    raw = tmp / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    out = tmp / "conversations.parquet"
    ingest.run(IngestConfig([raw], out, tmp / "rejects.jsonl"))
    return out


def test_ingest_is_unchanged(conversations: Path) -> None:
    assert _digest(conversations, ["id", "messages"]) == GOLDEN["conversations"]


@pytest.mark.parametrize("which", ["tiny", "qwen3"])
def test_tokenize_is_unchanged(
    which: str, conversations: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tokenizer = request.getfixturevalue(f"{which}_tokenizer_dir")
    out = tmp_path / "tokenized.parquet"
    tokenization.run(
        TokenizeConfig(conversations, tokenizer, out, tmp_path / "rejects.jsonl", workers=1)
    )
    assert pq.read_metadata(out).num_rows == len(RECORDS)
    assert _digest(out, ["id", "input_ids", "loss_mask"]) == GOLDEN[which]
