"""Fuzzed ingest: every generated record, in every supported shape, is written or refused by name.

Records are agent conversations as users' files hold them (OpenAI ``messages`` with
``tool_calls``, ``tool`` turns, ``reasoning_content`` and ``tools``; ShareGPT
``conversations`` with ``function_call`` / ``observation`` turns), well formed or damaged at one
random place, stored as JSONL, a JSON array, Parquet or a ``datasets`` directory, sometimes cut
short or given bytes that are not UTF-8. The real ingest runs on them. Whatever it meets:

- it returns (no exception of any kind);
- the output validates and no temporary file is left beside it;
- every record read is written, a duplicate, or in the rejects file with its file and record
  (``name:index``) and a reason that starts with its class and says where in the record.

``support.fuzz`` holds the settings (a bounded, derandomized sample here; ``tools/fuzz``
runs thousands) and counts outcomes per reader.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, note
from hypothesis import strategies as st

from eagle3_data.config import IngestConfig
from eagle3_data.ingest import run
from eagle3_schemas import validate
from eagle3_schemas.io.atomic import TEMP_MARKER

from support.fuzz import FUZZ, count, json_of, outcome, places

READER = "ingest"
REJECT_CLASSES = {
    "bad_json",
    "non_utf8",
    "unknown_format",
    "unknown_role",
    "empty_turn",
    "not_alternating",
    "no_assistant",
    "bad_tool_call",
    "unmatched_tool_result",
    "bad_reasoning",
    "bad_tools",
    "unreadable",
}
# A reason says where in the record: a turn or message, a field, the tools, or the bytes.
WHERE = re.compile(r"turn|message|field|tools|column|byte|record|array|object|UTF-8")

# Any text, lone surrogates included (a JSON file may escape them: "\ud800").
TEXT = st.text(st.characters(exclude_categories=()), max_size=6)
WORDS = st.sampled_from(["hi", "Sort a list.", "ok", "  ", "", "print(1)", "é", "\x00"])
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | TEXT
)
ANY_JSON = json_of(SCALARS, keys=TEXT | WORDS, max_leaves=6)
NAMES = st.sampled_from(["get_weather", "search", "f"])
ARGUMENTS = st.sampled_from(['{"city": "Paris"}', "{}", "[1]", "{", "", "null"]) | st.dictionaries(
    WORDS, SCALARS, max_size=2
)
TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAMES})},
    optional={"defer_loading": st.booleans()},
)
# Lines past what Python's json reads: nesting past its depth, an integer past its digits.
LIMITS = [b"\n" + b"[" * 5000 + b"\n", b'\n{"messages": ' + b"1" * 5000 + b"}\n"]
TOOLS = st.lists(TOOL, max_size=2) | st.lists(st.fixed_dictionaries({"name": NAMES}), max_size=2)


@st.composite
def openai_record(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed OpenAI-messages agent conversation."""
    turns: list[dict[str, Any]] = []
    if draw(st.booleans()):
        turns.append({"role": "system", "content": draw(WORDS.filter(str.strip))})
    for _ in range(draw(st.integers(1, 2))):
        question = draw(WORDS.filter(str.strip))
        if draw(st.booleans()):  # OpenAI content parts
            question = [{"type": "text", "text": question}, {"type": "image_url", "image_url": {}}]
        turns.append({"role": "user", "content": question})
        assistant: dict[str, Any] = {"role": "assistant", "content": "Let me check."}
        if draw(st.booleans()):
            assistant["reasoning_content"] = draw(WORDS)
        calls = draw(st.lists(NAMES, max_size=2))
        ids = [f"call_{len(turns)}_{k}" for k in range(len(calls))]
        if calls:
            assistant["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": n, "arguments": draw(ARGUMENTS)}}
                for i, n in zip(ids, calls, strict=True)
            ]
            # A call's id as agent data gets it wrong: missing, null, empty, a number, reused.
            call = assistant["tool_calls"][0]
            defect = draw(
                st.sampled_from(["none"] * 4 + ["missing", "null", "", "number", "reused"])
            )
            if defect == "missing":
                del call["id"]
            elif defect != "none":
                call["id"] = {"null": None, "": "", "number": 7, "reused": ids[-1]}[defect]
        turns.append(assistant)
        for i, n in zip(ids, calls, strict=True):
            turns.append({"role": "tool", "tool_call_id": i, "name": n, "content": "20 C"})
        if calls:
            turns.append({"role": "assistant", "content": draw(WORDS.filter(str.strip))})
    record: dict[str, Any] = {"messages": turns}
    if draw(st.booleans()):
        record["tools"] = draw(TOOLS | TOOLS.map(json.dumps))
    return record


@st.composite
def sharegpt_record(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed ShareGPT conversation, function calls answered in order."""
    turns: list[dict[str, Any]] = [{"from": "human", "value": draw(WORDS.filter(str.strip))}]
    for _ in range(draw(st.integers(0, 2))):
        call = {"name": draw(NAMES), "arguments": draw(ARGUMENTS)}
        value = draw(st.sampled_from([call, [call], json.dumps(call), json.dumps([call, call])]))
        turns.append({"from": draw(st.sampled_from(["function_call", "function"])), "value": value})
        answers = (
            2 if isinstance(value, str) and value.startswith("[") and value.count("{") > 2 else 1
        )
        turns += [{"from": "observation", "value": "20 C"}] * answers
    turns.append({"from": draw(st.sampled_from(["gpt", "assistant", "model"])), "value": "done"})
    record: dict[str, Any] = {"conversations": turns}
    if draw(st.booleans()):
        record["tools"] = draw(TOOLS)
    return record


@st.composite
def damaged(draw: st.DrawFn, record: dict[str, Any]) -> Any:
    """``record`` with one node replaced, deleted or given a sibling of any JSON value."""
    path = draw(st.sampled_from(places(record)))
    if not path:
        return draw(ANY_JSON)
    parent = record
    for key in path[:-1]:
        parent = parent[key]
    last = path[-1]
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        parent[last] = draw(ANY_JSON | WORDS | NAMES)
    elif action == "delete":
        del parent[last]
    elif isinstance(parent, dict):
        parent[draw(st.sampled_from(["id", "role", "content", "tool_calls", "name", "from"]))] = (
            draw(ANY_JSON)
        )
    else:
        parent.insert(last, draw(ANY_JSON))
    return record


@st.composite
def records(draw: st.DrawFn) -> Any:
    record = draw(openai_record() | sharegpt_record())
    return draw(damaged(record)) if draw(st.booleans()) else record


def _damage(file: Path, cut: int | None, junk: bytes) -> None:
    """Cut ``file`` at byte ``cut`` (modulo its size), then append ``junk``."""
    data = file.read_bytes()
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    file.write_bytes(data + junk)


def _write(
    path: Path, shape: str, rows: list[Any], cut: int | None, junk: bytes, blob: bytes | None
) -> Path:
    """``rows`` stored as ``shape`` (a table with a binary column ``blob`` beside, when given),
    maybe cut at byte ``cut`` or given ``junk``."""
    if shape in ("parquet", "datasets"):
        try:
            if not all(isinstance(r, dict) for r in rows):
                raise TypeError("a table holds objects only")
            table = pa.Table.from_pylist(rows)
            if blob is not None:  # as an image column of a real dataset
                table = table.append_column("blob", pa.array([blob] * len(rows), pa.binary()))
            if shape == "parquet":
                target = path.with_suffix(".parquet")
                pq.write_table(table, target)
                _damage(target, cut, junk)
                return target
            from datasets import Dataset, disable_progress_bars

            disable_progress_bars()
            target = path.with_suffix("")
            Dataset(table).save_to_disk(str(target))
            for arrow in sorted(target.glob("*.arrow"))[:1]:
                _damage(arrow, cut, junk)
            return target
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
            note(f"not storable as {shape} ({e}); written as JSONL")
            shape = "jsonl"
    if shape == "json":
        data = json.dumps(rows).encode()
        target = path.with_suffix(".json")
    else:
        data = b"\n".join(json.dumps(r).encode() for r in rows) + b"\n"
        target = path.with_suffix(".jsonl")
    target.write_bytes(data)
    _damage(target, cut, junk)
    return target


@FUZZ
@given(
    rows=st.lists(records(), min_size=1, max_size=3),
    shape=st.sampled_from(["jsonl", "jsonl", "json", "parquet", "datasets"]),
    cut=st.none() | st.none() | st.none() | st.integers(0, 1 << 12),
    junk=st.just(b"")
    | st.just(b"")
    | st.just(b"")
    | st.binary(max_size=6)
    | st.sampled_from(LIMITS),
    blob=st.none() | st.binary(max_size=4),
)
def test_fuzzed_records_are_written_or_refused_by_name(
    rows: list[Any], shape: str, cut: int | None, junk: bytes, blob: bytes | None
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = _write(root / "raw", shape, rows, cut, junk, blob)
        out, rejects = root / "out" / "conv.parquet", root / "out" / "rejects.jsonl"
        summary = outcome(READER, lambda: run(IngestConfig([raw], out, rejects)))
        assert validate(out) == []
        assert not [p.name for p in out.parent.iterdir() if TEMP_MARKER in p.name]
        refused = [json.loads(line) for line in rejects.read_bytes().splitlines()]
        assert summary.read == summary.written + summary.duplicates + len(refused)
        assert sum(summary.rejected.values()) == len(refused)
        count(READER, records=summary.read, written=summary.written, rejected=len(refused))
        label = raw.name
        for reject in refused:
            assert re.fullmatch(rf"{re.escape(label)}:\d+", reject["source"]), reject
            kind, _, detail = reject["reason"].partition(": ")
            assert kind in REJECT_CLASSES and detail, reject
            assert WHERE.search(detail), reject
            assert "record" in reject, reject
