"""Validate any artifact against its schema file and report every violation with its location.

Structure (files, columns, tensors, dtypes, shape symbols, header, lineage keys) is checked
generically from the schema file; the schema's named semantic checks run from
``eagle3_schemas.contract.checks``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.contract.checks import CHECKS, DEEP_CHECKS, symbols_from_header
from eagle3_schemas.contract.header import (
    DIRECTORY_HEADER_FILES,
    ArtifactError,
    Header,
    read_header,
)
from eagle3_schemas.contract.registry import artifact_kinds, load_schema, versions
from eagle3_schemas.io.safetensors_format import SafetensorsFormatError
from eagle3_schemas.layouts.conversations import CONVERSATION_TURNS_V2, MESSAGE_V2

ARROW_TYPES: dict[str, pa.DataType] = {
    "string": pa.string(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint8": pa.uint8(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "list<int32>": pa.list_(pa.int32()),
    "list<uint8>": pa.list_(pa.uint8()),
    "list<struct<role: string, content: string>>": pa.list_(
        pa.struct([("role", pa.string()), ("content", pa.string())])
    ),
    CONVERSATION_TURNS_V2: pa.list_(MESSAGE_V2),
}


def detect_kind(path: str | os.PathLike[str]) -> str:
    """The artifact kind ``path`` declares in its header (raises ArtifactError)."""
    return read_header(path).artifact


def validate(path: str | os.PathLike[str], deep: bool = True) -> list[Violation]:
    """Every violation of ``path`` against the schema its header names; empty when valid.

    ``deep=False`` skips the checks that read every stored value (row checksums, NaN/Inf
    scans): seconds instead of a full read for a multi-terabyte hidden-state dataset.
    """
    path = Path(path)
    if not path.exists():
        return [Violation(str(path), "(path)", "does not exist")]
    try:
        header = read_header(path)
    except (ArtifactError, SafetensorsFormatError, OSError) as e:
        return [Violation(str(path), "(header)", str(e))]
    if header.artifact not in artifact_kinds():
        message = f"unknown artifact kind {header.artifact!r}; expected one of {artifact_kinds()}"
        return [Violation(str(path), "header.artifact", message)]
    known = versions(header.artifact)
    # true and 1.0 equal 1 but name no schema file: the version must be an int itself
    if type(header.schema_version) is not int or header.schema_version not in known:
        message = f"{header.artifact} schema version {header.schema_version!r} is not one this library reads (known: {known})"
        return [Violation(str(path), "header.schema_version", message)]
    art = Artifact(path, header, load_schema(header.artifact, header.schema_version))
    where = _header_file(art)
    violations = _check_header(art, where)
    try:
        bindings = symbols_from_header(art)
    except Exception as e:  # header or config.json of any shape: a None, a 0 head count
        message = f"cannot read the sizes this artifact declares: {type(e).__name__}: {e}"
        violations.append(Violation(where, "(symbols)", message))
        bindings = {}
    for role, spec in art.schema["files"].items():
        violations += _check_file_role(art, role, spec, bindings)
    if violations:  # semantic checks assume sound structure
        return violations
    for name, check in CHECKS[art.kind].items():
        if name not in art.schema.get("checks", {}):
            continue  # a later schema version's check: this artifact's version does not promise it
        if not deep and name in DEEP_CHECKS:
            continue
        try:
            violations += check(art)
        except Exception as e:  # a check that cannot run is itself a finding
            violations.append(
                Violation(str(path), f"check {name}", f"could not run: {type(e).__name__}: {e}")
            )
    return violations


def header_violations(header: Header, where: str) -> list[Violation]:
    """``header`` against the header rules of the schema version it names."""
    known = versions(header.artifact) if header.artifact in artifact_kinds() else []
    if type(header.schema_version) is not int or header.schema_version not in known:
        return [
            Violation(where, "header.schema_version", f"{header.schema_version!r} not in {known}")
        ]
    art = Artifact(Path(where), header, load_schema(header.artifact, header.schema_version))
    return _check_header(art, where)


def _header_file(art: Artifact) -> str:
    if art.root.is_dir():
        return art.rel(art.root / DIRECTORY_HEADER_FILES[art.kind])
    return str(art.root)


def _check_header(art: Artifact, where: str) -> list[Violation]:
    out = []
    validator = jsonschema.Draft202012Validator(art.schema["header"]["fields"])
    for err in validator.iter_errors(art.header.fields):
        loc = (
            "header." + ".".join(str(p) for p in err.absolute_path)
            if err.absolute_path
            else "header"
        )
        out.append(Violation(where, loc, err.message))
    for key, meaning in art.schema["lineage"]["required"].items():
        if key not in art.header.lineage:
            out.append(Violation(where, f"header.lineage.{key}", f"missing ({meaning})"))
        elif art.header.lineage[key] in (None, ""):
            out.append(Violation(where, f"header.lineage.{key}", f"empty ({meaning})"))
    return out


def _check_file_role(
    art: Artifact, role: str, spec: dict[str, Any], bindings: dict[str, int]
) -> list[Violation]:
    pattern = spec["path"]
    if pattern == ".":
        paths = [art.root]
    elif "*" in pattern:
        paths = sorted(art.root.glob(pattern))
    else:
        paths = [art.root / pattern] if (art.root / pattern).exists() else []
    art.files[role] = paths
    if not paths:
        missing = Violation(str(art.root), pattern, "required file is missing")
        return [missing] if spec["required"] else []
    out: list[Violation] = []
    for path in paths:
        local = dict(bindings)
        found = {
            "parquet": _check_parquet,
            "safetensors": _check_safetensors,
            "json": _check_json,
        }[spec["format"]](art, path, spec, local)
        if "*" not in pattern:  # sizes seen in a single file hold for the whole artifact
            bindings.update(local)
        if found:
            art.broken.add(path)
        out += found
    return out


def _check_parquet(
    art: Artifact, path: Path, spec: dict[str, Any], _: dict[str, int]
) -> list[Violation]:
    where = art.rel(path)
    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (pa.ArrowException, OSError, ValueError) as e:  # ValueError: a footer not UTF-8
        return [Violation(where, "(file)", f"not a readable Parquet file: {e}")]
    out, non_nullable = [], []
    for name, col in spec["columns"].items():
        if name not in schema.names:
            out.append(Violation(where, f"column {name}", f"missing (expected {col['type']})"))
            continue
        want, got = ARROW_TYPES[col["type"]], schema.field(name).type
        if not got.equals(want):
            out.append(Violation(where, f"column {name}", f"type {got}, expected {col['type']}"))
        elif not col.get("nullable", True):
            non_nullable.append(name)
    try:
        nulls: dict[str, tuple[int, int]] = {}  # column -> (first null row, count)
        for first, batch in art.batches(path, non_nullable):
            for name in non_nullable:
                column = batch.column(name)
                if column.null_count:
                    row = first + column.is_null().to_pylist().index(True)
                    seen_row, count = nulls.get(name, (row, 0))
                    nulls[name] = (seen_row, count + column.null_count)
    except (pa.ArrowException, OSError, ValueError) as e:
        return [*out, Violation(where, "(file)", f"not a readable Parquet file: {e}")]
    for name, (row, count) in nulls.items():
        message = f"null in a non-nullable column ({count} nulls)"
        out.append(Violation(where, f"row {row}, column {name}", message))
    return out


def _check_safetensors(
    art: Artifact, path: Path, spec: dict[str, Any], bindings: dict[str, int]
) -> list[Violation]:
    where = art.rel(path)
    try:
        st = art.safetensors(path)
    except (SafetensorsFormatError, OSError) as e:
        return [Violation(where, "(file)", str(e))]
    out: list[Violation] = []

    def bad(name: str, message: str) -> None:
        out.append(Violation(where, f"tensor {name}", message))

    for name, tspec in spec["tensors"].items():
        info = st.tensors.get(name)
        if info is None:
            if tspec["required"]:
                bad(name, f"missing (expected {'|'.join(tspec['dtype'])} {tspec['shape']})")
            continue
        if info.dtype not in tspec["dtype"]:
            bad(name, f"dtype {info.dtype}, expected one of {tspec['dtype']}")
        shape = tspec["shape"]
        if len(info.shape) != len(shape):
            bad(name, f"shape {list(info.shape)} has {len(info.shape)} dims, expected {shape}")
            continue
        for axis, (dim, size) in enumerate(zip(shape, info.shape, strict=True)):
            want = dim if isinstance(dim, int) else bindings.setdefault(dim, size)
            if size != want:
                label = f"{dim}={want}" if isinstance(dim, str) else str(want)
                bad(
                    name,
                    f"shape {list(info.shape)}: dim {axis} is {size}, expected {label} (schema shape {shape})",
                )
    if spec.get("extra_tensors") == "forbidden":
        for name in sorted(set(st.tensors) - set(spec["tensors"])):
            bad(name, "not allowed by the schema")
    return out


def _check_json(
    art: Artifact, path: Path, spec: dict[str, Any], _: dict[str, int]
) -> list[Violation]:
    where = art.rel(path)
    try:
        obj = art.json(path)
    except (OSError, ValueError, RecursionError) as e:  # a directory, bad UTF-8 or JSON
        return [Violation(where, "(file)", f"not a readable UTF-8 JSON file: {e}")]
    validator = jsonschema.Draft202012Validator(spec["json_schema"])
    return [
        Violation(where, ".".join(str(p) for p in err.absolute_path) or "(top)", err.message)
        for err in validator.iter_errors(obj)
    ]
