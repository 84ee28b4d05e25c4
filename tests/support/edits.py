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

from eagle3_schemas.contract.header import HEADER_KEY, read_header
from eagle3_schemas.io.safetensors_format import NUMPY_VIEWS, read_safetensors
from eagle3_schemas.layouts.hidden_states import row_checksum


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


def _to_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # stored as uint16: the high half of a float32
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(np.float32)


def _from_float32(array: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # round to nearest even, as torch does
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return array.astype({"F32": np.float32, "F16": np.float16}[dtype])


def map_hidden_state_rows(
    dataset: Path, tensor: str, transform: Callable[[np.ndarray], np.ndarray]
) -> None:
    """Replace each sample's rows of a per-token tensor (``aux_hidden_states`` or
    ``last_hidden_state``) of a hidden-state dataset by ``transform(rows)`` (float32 in and
    out, stored back in the tensor's dtype), then rewrite the manifest checksums over the new
    bytes: the dataset stays schema-valid, as a backend with that bug would have written it."""
    manifest_path = dataset / "manifest.parquet"
    manifest = pq.read_table(manifest_path)
    spans = list(
        zip(
            manifest.column("shard").to_pylist(),
            manifest.column("row_start").to_pylist(),
            manifest.column("num_tokens").to_pylist(),
            strict=True,
        )
    )
    for shard in sorted({name for name, _, _ in spans}):
        path = dataset / shard
        info = read_safetensors(path).tensors[tensor]
        view = NUMPY_VIEWS[info.dtype]
        data = bytearray(path.read_bytes())  # edited in place: header and dtype stay as written
        values = np.frombuffer(data, dtype=view, count=info.numel, offset=info.start)
        values = values.reshape(info.shape)
        for name, start, n in spans:
            if name == shard:
                rows = _to_float32(values[start : start + n], info.dtype)
                values[start : start + n] = _from_float32(transform(rows), info.dtype)
        path.write_bytes(bytes(data))
    rewrite_checksums(dataset)


def rewrite_checksums(dataset: Path) -> None:
    """Recompute every manifest checksum of a hidden-state dataset over its stored rows, with
    the algorithm of the schema version its header declares."""
    version = read_header(dataset).schema_version
    manifest_path = dataset / "manifest.parquet"
    manifest = pq.read_table(manifest_path)
    spans = zip(
        manifest.column("shard").to_pylist(),
        manifest.column("row_start").to_pylist(),
        manifest.column("num_tokens").to_pylist(),
        strict=True,
    )
    checksums = [row_checksum(read_safetensors(dataset / s), a, n, version) for s, a, n in spans]
    column = pa.array(checksums, type=manifest.schema.field("checksum").type)
    index = manifest.schema.get_field_index("checksum")
    pq.write_table(manifest.set_column(index, "checksum", column), manifest_path)


def as_hidden_states_v1(dataset: Path) -> None:
    """Turn a hidden-state dataset into what a v1 writer made of the same data: v2 changed
    only the checksum (XXH3-128 for blake2b-128), so the header's version and the manifest
    checksums are all that differ."""
    rewrite_header(dataset, lambda h: h.__setitem__("schema_version", 1))
    rewrite_checksums(dataset)
