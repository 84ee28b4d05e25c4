"""The artifact header: ``{"artifact", "schema_version", "lineage", ...fields}``.

Single-file artifacts carry it inside the file (Parquet schema metadata or safetensors
``__metadata__``, key ``eagle3``); directory artifacts in a JSON file named by their schema.
Writers here put the header where the schema says, atomically.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_schemas.contract.registry import load_schema
from eagle3_schemas.io.atomic import atomic_path, write_json_atomic
from eagle3_schemas.io.safetensors_format import read_safetensors

HEADER_KEY = "eagle3"
# Directory artifacts: the JSON file holding the header.
DIRECTORY_HEADER_FILES = {
    "hidden_states": "dataset.json",
    "draft_checkpoint": "eagle3.json",
    "eval_report": "report.json",
}


class ArtifactError(ValueError):
    """An artifact cannot be read as what it claims to be."""


@dataclass(frozen=True)
class Header:
    artifact: str
    schema_version: int
    lineage: dict[str, Any]
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact": self.artifact,
            "schema_version": self.schema_version,
            "lineage": self.lineage,
            **self.fields,
        }

    @classmethod
    def from_json(cls, obj: Any, where: str) -> Header:
        if not isinstance(obj, dict):
            raise ArtifactError(
                f"{where}: header must be a JSON object, found {type(obj).__name__}"
            )
        missing = [k for k in ("artifact", "schema_version", "lineage") if k not in obj]
        if missing:
            raise ArtifactError(f"{where}: header lacks {', '.join(missing)}")
        if not isinstance(obj["lineage"], dict):
            raise ArtifactError(f"{where}: header field 'lineage' must be an object")
        rest = {k: v for k, v in obj.items() if k not in ("artifact", "schema_version", "lineage")}
        return cls(obj["artifact"], obj["schema_version"], obj["lineage"], rest)


def make_header(artifact: str, lineage: Mapping[str, Any], **fields: Any) -> Header:
    """A header for the newest schema version of ``artifact``."""
    return Header(artifact, load_schema(artifact)["version"], dict(lineage), fields)


def read_header(path: str | os.PathLike[str]) -> Header:
    """Read the header of any artifact (file or directory), without validating the rest."""
    path = Path(path)
    if path.is_dir():
        for name in DIRECTORY_HEADER_FILES.values():
            if (path / name).is_file():
                return _read_json_header(path / name)
        raise ArtifactError(
            f"{path}: no artifact header file; expected one of {sorted(DIRECTORY_HEADER_FILES.values())}"
        )
    if path.suffix == ".parquet":
        try:
            metadata = pq.read_metadata(path).metadata or {}
        except (pa.ArrowException, OSError, ValueError) as e:  # and UnicodeDecodeError: damage
            raise ArtifactError(f"{path}: not a readable Parquet file ({e})") from e
        raw = metadata.get(HEADER_KEY.encode())
        if raw is None:
            raise ArtifactError(f"{path}: Parquet key-value metadata has no '{HEADER_KEY}' header")
        return _parse(raw, f"{path} (Parquet metadata '{HEADER_KEY}')")
    if path.suffix == ".safetensors":
        raw_text = read_safetensors(path).metadata.get(HEADER_KEY)
        if raw_text is None:
            raise ArtifactError(f"{path}: safetensors __metadata__ has no '{HEADER_KEY}' header")
        return _parse(raw_text, f"{path} (safetensors __metadata__ '{HEADER_KEY}')")
    if path.suffix == ".json":
        return _read_json_header(path)
    raise ArtifactError(
        f"{path}: unknown artifact file type (expected .parquet, .safetensors, .json or a directory)"
    )


def _read_json_header(path: Path) -> Header:
    try:
        return Header.from_json(json.loads(path.read_text(encoding="utf-8")), str(path))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, nesting, a 5000-digit int
        raise ArtifactError(f"{path}: not valid UTF-8 JSON ({e})") from e


def _parse(text: str | bytes, where: str) -> Header:
    try:
        return Header.from_json(
            json.loads(text.decode("utf-8") if isinstance(text, bytes) else text), where
        )
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, nesting, a 5000-digit int
        raise ArtifactError(f"{where}: header is not valid UTF-8 JSON ({e})") from e


def write_parquet(
    path: str | os.PathLike[str], table: pa.Table, header: Header | None = None
) -> None:
    """Write ``table`` atomically, with ``header`` (if given) in its schema metadata."""
    if header is not None:
        metadata = dict(table.schema.metadata or {})
        metadata[HEADER_KEY.encode()] = json.dumps(header.to_json(), sort_keys=True).encode()
        table = table.replace_schema_metadata(metadata)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


class ParquetStream:
    """Rows written batch by batch; the header, known only at the end, goes in last."""

    def __init__(self, writer: pq.ParquetWriter) -> None:
        self._writer = writer
        self.header: Header | None = None
        self.num_rows = 0

    def write(self, batch: pa.Table | pa.RecordBatch) -> None:
        self._writer.write(batch)
        self.num_rows += batch.num_rows


@contextlib.contextmanager
def parquet_stream(path: str | os.PathLike[str], schema: pa.Schema) -> Iterator[ParquetStream]:
    """Stream rows into a Parquet artifact with bounded memory, atomically.

    Set ``stream.header`` before the block ends; the file appears under ``path`` only then.
    """
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        stream = ParquetStream(writer)
        yield stream
        if stream.header is None:
            raise ValueError(
                f"{path}: the artifact header was never set; refusing to publish a file without one"
            )
        writer.add_key_value_metadata(
            {HEADER_KEY: json.dumps(stream.header.to_json(), sort_keys=True)}
        )


def write_safetensors(
    path: str | os.PathLike[str], tensors: Mapping[str, Any], header: Header | None = None
) -> None:
    """Write numpy arrays or torch tensors (never mixed) atomically, ``header`` in ``__metadata__``.

    torch is imported only when torch tensors are given, so torch-free stages can write too.
    """
    metadata = (
        {HEADER_KEY: json.dumps(header.to_json(), sort_keys=True)} if header is not None else None
    )
    values = list(tensors.values())
    with atomic_path(path) as tmp:
        if values and type(values[0]).__module__.startswith("torch"):
            from safetensors.torch import save_file as save_torch

            save_torch({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)
        else:
            from safetensors.numpy import save_file as save_numpy

            save_numpy(dict(tensors), str(tmp), metadata=metadata)


def write_json_header(path: str | os.PathLike[str], header: Header) -> None:
    """Write a directory artifact's header file, atomically."""
    write_json_atomic(path, header.to_json())
