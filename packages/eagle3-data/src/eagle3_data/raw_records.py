"""Raw chat files read record by record, for ingest: JSONL line by line, JSON arrays object by
object, Parquet by row group, ``datasets`` directories saved with ``save_to_disk``; memory
stays bounded by one record or batch. A record that cannot be read or stored (bad JSON, text
that is not UTF-8, a lone surrogate, an unreadable file) comes back with its reason, for the
rejects file, instead of stopping the run. What a record means is ``ingest``'s.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.config import RAW_EXPECTED

JSON_CHUNK_CHARS = 1 << 20


@dataclass
class RawRecord:
    source: str  # "file:index" — where to look
    value: Any = None  # the parsed record
    raw: str = ""  # original text when the record failed to parse
    error: str | None = None


def records(inputs: list[Path]) -> Iterator[RawRecord]:
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
                str(path), error=f"unknown_format: {path.name}: expected {RAW_EXPECTED}"
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
                value = json.loads(text)
            except (ValueError, RecursionError) as e:
                yield RawRecord(source, raw=text.rstrip("\n"), error=f"bad_json: {_json_error(e)}")
                continue
            yield _unstorable(source, value, text.rstrip("\n"))


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
                except (ValueError, RecursionError) as e:
                    if eof:
                        yield RawRecord(
                            f"{path.name}:{index}",
                            raw=buffer[pos : pos + 10_000],
                            error=f"bad_json: {_json_error(e)} in record {index}; the rest of the file is unreadable",
                        )
                        return
                    break  # incomplete: read more
                yield _unstorable(f"{path.name}:{index}", value, buffer[pos:end])
                index, pos = index + 1, end
            if eof:
                return


def _json_error(e: ValueError | RecursionError) -> str:
    """What json could not read: its message, or the limit the value passed."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at column {e.colno}"
    if isinstance(e, RecursionError):
        return "the record nests deeper than the JSON reader's limit"
    # an integer longer than Python's digit limit
    return f"a number in the record is too long to read ({str(e).split(';')[0]})"


def _unstorable(source: str, value: Any, raw: str) -> RawRecord:
    """The parsed record, or its refusal when a string in it holds a lone surrogate (a JSON
    escape such as \\ud800 with no pair): no UTF-8 file, the output or the rejects, can store
    it. Only text with a \\ud escape is searched."""
    if "\\ud" in raw.lower():
        where = _surrogate_at(value, "")
        if where is not None:
            return RawRecord(
                source,
                raw=raw,
                error=f"non_utf8: field {where or 'record'}: a \\ud800-\\udfff escape without its pair (a lone surrogate) is not text",
            )
    return RawRecord(source, value=value)


def _surrogate_at(value: Any, where: str) -> str | None:
    """The path of the first string (key or value) in ``value`` that UTF-8 cannot encode."""
    items: Any = ()
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        items = ((f"{where}.{k}" if where else str(k), k, v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{where}[{i}]", None, v) for i, v in enumerate(value))
    for path, key, child in items:
        if key is not None and _surrogate_at(key, path) is not None:
            return path
        found = _surrogate_at(child, path)
        if found is not None:
            return found
    return None


def _unreadable(source: str, what: str, e: Exception) -> RawRecord:
    return RawRecord(
        source,
        error=f"unreadable: {what} cannot be read from record {source.rsplit(':', 1)[1]} on "
        f"({type(e).__name__}: {str(e)[:300]}); the rest of the file is unread",
    )


def _parquet_records(path: Path) -> Iterator[RawRecord]:
    index = 0
    try:  # a damaged file fails when opened or at the row group it damages
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield RawRecord(f"{path.name}:{index}", value=row)
                index += 1
    except (pa.ArrowException, OSError, ValueError) as e:
        yield _unreadable(f"{path.name}:{index}", f"{path.name} (Parquet)", e)


def _datasets_records(path: Path) -> Iterator[RawRecord]:
    from datasets import Dataset, DatasetDict, load_from_disk

    # datasets raises what its own parts raise on a damaged directory (IndexError on a table
    # of no columns, Arrow's errors, FileNotFoundError, JSON errors): each refuses the input.
    try:
        loaded = load_from_disk(str(path))
    except Exception as e:
        yield _unreadable(f"{path.name}:0", f"{path.name} (a datasets directory)", e)
        return
    splits = loaded.items() if isinstance(loaded, DatasetDict) else [("", loaded)]
    for split, dataset in splits:
        assert isinstance(dataset, Dataset)
        label = f"{path.name}[{split}]" if split else path.name
        index = 0
        try:
            for row in dataset:
                yield RawRecord(f"{label}:{index}", value=row)
                index += 1
        except Exception as e:
            yield _unreadable(f"{label}:{index}", f"{label} (a datasets directory)", e)
