"""Rewrite parts of a valid artifact in place: the corruptions that validation must reject."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from safetensors.numpy import save_file

from eagle3_schemas.header import HEADER_KEY
from eagle3_schemas.safetensors_format import read_safetensors


def load_tensors(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    st = read_safetensors(path)
    return {name: st.array(name).copy() for name in st.tensors}, dict(st.metadata)


def rewrite_tensors(path: Path, mutate: Callable[[dict[str, np.ndarray]], None]) -> None:
    tensors, metadata = load_tensors(path)
    mutate(tensors)
    save_file(tensors, str(path), metadata=metadata or None)


def rewrite_parquet(path: Path, mutate: Callable[[dict[str, list[Any]]], None]) -> None:
    table = pq.read_table(path)
    columns = table.to_pydict()
    mutate(columns)
    fields = [table.schema.field(name) for name in columns]
    pq.write_table(
        pa.table(columns, schema=pa.schema(fields, metadata=table.schema.metadata)), path
    )


def rewrite_header(path: Path, mutate: Callable[[dict[str, Any]], None]) -> None:
    """Change the header wherever the artifact keeps it."""
    if path.is_dir():
        header_file = next(
            path / n for n in ("dataset.json", "eagle3.json", "report.json") if (path / n).is_file()
        )
        header = json.loads(header_file.read_text())
        mutate(header)
        header_file.write_text(json.dumps(header))
    elif path.suffix == ".parquet":
        table = pq.read_table(path)
        metadata = dict(table.schema.metadata)
        header = json.loads(metadata[HEADER_KEY.encode()])
        mutate(header)
        metadata[HEADER_KEY.encode()] = json.dumps(header).encode()
        pq.write_table(table.replace_schema_metadata(metadata), path)
    else:
        tensors, metadata = load_tensors(path)
        header = json.loads(metadata[HEADER_KEY])
        mutate(header)
        metadata[HEADER_KEY] = json.dumps(header)
        save_file(tensors, str(path), metadata=metadata)


def artifact_files(root: Path) -> list[Path]:
    return [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
