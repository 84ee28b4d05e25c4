"""ingest: raw chat data in any common layout → the conversations artifact.

Reads ShareGPT (``conversations`` of ``from``/``value``, JSON array or JSONL), OpenAI
``messages`` JSONL, Parquet with either column, and ``datasets`` directories saved with
``save_to_disk``. Everything streams: JSONL line by line, JSON arrays object by object,
Parquet by row group, so memory stays bounded by one batch plus the set of seen ids.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.config import RAW_EXPECTED, IngestConfig
from eagle3_data.rejects import RejectsFile
from eagle3_schemas.conversations import conversation_id, conversation_problem
from eagle3_schemas.header import make_header, parquet_stream
from eagle3_schemas.lineage import fingerprint_file, fingerprint_files, fingerprint_json

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
}
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])
SCHEMA = pa.schema([("id", pa.string()), ("messages", pa.list_(MESSAGE)), ("source", pa.string())])
JSON_CHUNK_CHARS = 1 << 20


@dataclass
class RawRecord:
    source: str  # "file:index" — where to look
    value: Any = None  # the parsed record
    raw: str = ""  # original text when the record failed to parse
    error: str | None = None


@dataclass
class IngestSummary:
    read: int = 0
    written: int = 0
    skipped: int = 0  # not selected by --keep
    duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


def run(config: IngestConfig) -> IngestSummary:
    config.check()
    summary = IngestSummary()
    seen: set[str] = set()
    batch: dict[str, list[Any]] = {"id": [], "messages": [], "source": []}
    with RejectsFile(config.rejects) as rejects, parquet_stream(config.output, SCHEMA) as out:
        for record in _records(config.inputs):
            summary.read += 1
            if record.error is not None:
                rejects.add(record.source, record.error, record.raw)
                continue
            if config.keep and not _selected(record.value, config.keep):
                summary.skipped += 1
                continue
            messages = normalise(record.value)
            problem = messages if isinstance(messages, str) else conversation_problem(messages)
            if problem is not None:
                rejects.add(record.source, problem, record.value)
                continue
            assert not isinstance(messages, str)
            sample_id = conversation_id(messages)
            if sample_id in seen:
                summary.duplicates += 1
                continue
            seen.add(sample_id)
            for key, value in (
                ("id", sample_id),
                ("messages", messages),
                ("source", record.source),
            ):
                batch[key].append(value)
            if len(batch["id"]) >= config.batch_rows:
                out.write(pa.table(batch, schema=SCHEMA))
                batch = {k: [] for k in batch}
        if batch["id"]:
            out.write(pa.table(batch, schema=SCHEMA))
        summary.written = out.num_rows
        summary.rejected = dict(rejects.reasons)
        lineage = {"source_fingerprint": source_fingerprint(config.inputs), "generator": "original"}
        out.header = make_header(
            "conversations",
            lineage,
            num_rows=out.num_rows,
            num_rejected=rejects.count,
            inputs=[str(p) for p in config.inputs],
            duplicates=summary.duplicates,
            skipped=summary.skipped,
            keep=config.keep,
        )
    return summary


def _selected(record: Any, keep: dict[str, str]) -> bool:
    return isinstance(record, dict) and all(str(record.get(k)) == v for k, v in keep.items())


def source_fingerprint(inputs: list[Path]) -> str:
    parts = []
    for path in inputs:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        parts.append(
            [path.name, fingerprint_files(files, path) if path.is_dir() else fingerprint_file(path)]
        )
    return fingerprint_json(parts)


# ---- normalisation -----------------------------------------------------------------------


def normalise(record: Any) -> list[dict[str, str]] | str:
    """[{role, content}] in the project's roles, or the reason the record cannot be read."""
    if not isinstance(record, dict):
        return f"unknown_format: expected a JSON object per record, found {type(record).__name__}"
    turns = record.get("messages")
    if turns is None:
        turns = record.get("conversations")
    if not isinstance(turns, list):
        return "unknown_format: expected a 'messages' (OpenAI) or 'conversations' (ShareGPT) list"
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"unknown_format: turn {i} is a {type(turn).__name__}, expected an object"
        role = turn.get("role", turn.get("from"))
        normalised = ROLE_ALIASES.get(str(role).lower()) if isinstance(role, str) else None
        if normalised is None:
            return (
                f"unknown_role: turn {i}: role {role!r} (known: {', '.join(sorted(ROLE_ALIASES))})"
            )
        content = turn.get("content", turn.get("value"))
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and p.get("type") == "text"
            )
        if content is not None and not isinstance(content, str):
            return f"unknown_format: turn {i}: content is a {type(content).__name__}, expected text"
        messages.append({"role": normalised, "content": content or ""})
    return messages


# ---- readers -----------------------------------------------------------------------------


def _records(inputs: list[Path]) -> Iterator[RawRecord]:
    for path in inputs:
        if path.is_dir():
            yield from _datasets_records(path)
        elif path.suffix == ".parquet":
            yield from _parquet_records(path)
        elif path.suffix == ".jsonl":
            yield from _jsonl_records(path)
        elif path.suffix == ".json":
            yield from _json_array_records(path)
        else:  # IngestConfig.check refuses these up front; a direct caller still gets a reason
            yield RawRecord(
                str(path), raw="", error=f"unknown_format: {path.name}: expected {RAW_EXPECTED}"
            )


def _jsonl_records(path: Path) -> Iterator[RawRecord]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            source = f"{path.name}:{number}"
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raw = line.decode("utf-8", "backslashreplace").rstrip("\n")
                yield RawRecord(
                    source, raw=raw, error=f"non_utf8: byte {e.start} of line {number} is not UTF-8"
                )
                continue
            try:
                yield RawRecord(source, value=json.loads(text))
            except json.JSONDecodeError as e:
                yield RawRecord(
                    source, raw=text.rstrip("\n"), error=f"bad_json: {e.msg} at column {e.colno}"
                )


def _json_array_records(path: Path) -> Iterator[RawRecord]:
    """Stream the elements of a top-level JSON array (or a single top-level object)."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")("strict")
    buffer, pos, index, started, eof = "", 0, 0, False, False
    with open(path, "rb") as f:
        while True:
            if not eof:
                chunk = f.read(JSON_CHUNK_CHARS)
                eof = not chunk
                try:
                    buffer = buffer[pos:] + utf8.decode(chunk, final=eof)
                except UnicodeDecodeError as e:
                    yield RawRecord(
                        f"{path.name}:{index}",
                        raw="",
                        error=f"non_utf8: {path.name} is not UTF-8 near record {index} ({e.reason}); the rest of the file is unread",
                    )
                    return
                pos = 0
            while True:
                while pos < len(buffer) and buffer[pos] in " \t\r\n,":
                    pos += 1
                if not started and pos < len(buffer):
                    if buffer[pos] == "{":  # a single object, not an array
                        started = True
                    elif buffer[pos] == "[":
                        started, pos = True, pos + 1
                        continue
                    else:
                        yield RawRecord(
                            f"{path.name}:0",
                            raw=buffer[pos : pos + 200],
                            error="bad_json: expected a JSON array of records",
                        )
                        return
                if pos < len(buffer) and buffer[pos] == "]":
                    return
                if pos >= len(buffer):
                    break
                try:
                    value, end = decoder.raw_decode(buffer, pos)
                except json.JSONDecodeError as e:
                    if eof:
                        yield RawRecord(
                            f"{path.name}:{index}",
                            raw=buffer[pos : pos + 10_000],
                            error=f"bad_json: {e.msg} in record {index}; the rest of the file is unreadable",
                        )
                        return
                    break  # incomplete: read more
                yield RawRecord(f"{path.name}:{index}", value=value)
                index, pos = index + 1, end
            if eof:
                return


def _parquet_records(path: Path) -> Iterator[RawRecord]:
    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield RawRecord(f"{path.name}:{index}", value=row)
            index += 1


def _datasets_records(path: Path) -> Iterator[RawRecord]:
    from datasets import Dataset, DatasetDict, load_from_disk

    loaded = load_from_disk(str(path))
    splits = loaded.items() if isinstance(loaded, DatasetDict) else [("", loaded)]
    for split, dataset in splits:
        assert isinstance(dataset, Dataset)
        label = f"{path.name}[{split}]" if split else path.name
        for index, row in enumerate(dataset):
            yield RawRecord(f"{label}:{index}", value=row)
