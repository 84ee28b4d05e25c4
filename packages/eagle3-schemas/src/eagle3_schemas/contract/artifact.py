"""An artifact under validation (``Artifact``) and what validation finds (``Violation``).

Shared by the generic structure checks (``validate``) and the named semantic checks
(``checks``), which therefore do not import each other back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_schemas.contract.header import Header
from eagle3_schemas.io.safetensors_format import SafetensorsFile, read_safetensors

BATCH_ROWS = 8192


@dataclass(frozen=True)
class Violation:
    file: str
    location: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.location}: {self.message}"


@dataclass(eq=False)
class Artifact:
    """An artifact being validated: its header, schema, and its files by role."""

    root: Path
    header: Header
    schema: dict[str, Any]
    files: dict[str, list[Path]] = field(default_factory=dict)
    broken: set[Path] = field(default_factory=set)  # files with structural violations

    @property
    def kind(self) -> str:
        return self.header.artifact

    def path(self, role: str) -> Path:
        return self.files[role][0]

    def rel(self, path: Path) -> str:
        return (
            str(path)
            if path == self.root
            else f"{self.root}/{path.relative_to(self.root).as_posix()}"
        )

    _loaded: dict[tuple[str, Path], Any] = field(default_factory=dict)

    def _load(self, kind: str, path: Path, loader: Any) -> Any:
        key = (kind, path)
        if key not in self._loaded:
            self._loaded[key] = loader(path)
        return self._loaded[key]

    def safetensors(self, path: Path) -> SafetensorsFile:
        return self._load("safetensors", path, read_safetensors)

    def table(self, path: Path) -> pa.Table:
        """The whole table: only for small files (manifests, per-sample reports)."""
        return self._load("parquet", path, pq.read_table)

    def batches(self, path: Path, columns: list[str]) -> Iterator[tuple[int, pa.RecordBatch]]:
        """``(first row, batch)`` pairs: row checks stream, so memory stays bounded."""
        first = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=columns):
            yield first, batch
            first += batch.num_rows

    def json(self, path: Path) -> Any:
        return self._load("json", path, lambda p: json.loads(p.read_text(encoding="utf-8")))
