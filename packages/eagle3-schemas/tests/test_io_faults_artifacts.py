"""Fault injection into the artifact writers the stages publish through: Parquet (``write_parquet``,
``parquet_stream``) and safetensors (``write_safetensors``, numpy and torch). For every k up to
the writes, fsyncs and renames a tiny artifact takes, the k-th fails with ENOSPC or EIO: the
final name then holds the old artifact, whole (or none, where there was none), never a torn
file; no temporary file is left; and the error names the file (DiskFull for a full disk).

pyarrow and safetensors write from native code; support.iofaults routes their writes through
counted Python files, and raises a safetensors failure as its Rust writer does
(``SafetensorError`` "... (os error 28)"), which is what the atomic writer has to recognise.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.numpy import load_file

from eagle3_schemas.contract.header import (
    Header,
    parquet_stream,
    read_header,
    write_parquet,
    write_safetensors,
)
from eagle3_schemas.io.diskspace import DiskFull

from support.iofaults import count_calls, failing, leftovers

SCHEMA = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32()))])


def _header(version: str) -> Header:
    return Header("tokenized", 1, {"source": version}, {"num_rows": 3})


def _table(version: str) -> pa.Table:
    return pa.table(
        {"id": [f"{version}-{i}" for i in range(3)], "input_ids": [[1, 2], [3], [4, 5, 6]]},
        schema=SCHEMA,
    )


def _parquet(path: Path, version: str) -> None:
    write_parquet(path, _table(version), _header(version))


def _stream(path: Path, version: str) -> None:
    with parquet_stream(path, SCHEMA) as out:
        for batch in _table(version).to_batches(max_chunksize=1):  # three row groups
            out.write(pa.Table.from_batches([batch]))
        out.header = _header(version)


def _read_parquet(path: Path) -> Any:
    return pq.read_table(path).to_pylist(), read_header(path)


def _tensors(version: str) -> dict[str, np.ndarray]:
    seed = sum(map(ord, version))
    return {
        "d2t": np.arange(40, dtype=np.int64) + seed,
        "t2d": np.arange(300) % 3 == seed % 3,
        "token_counts": np.full(300, seed, dtype=np.int64),
    }


def _numpy(path: Path, version: str) -> None:
    write_safetensors(path, _tensors(version), _header(version))


def _torch(path: Path, version: str) -> None:
    tensors = {k: torch.from_numpy(v) for k, v in _tensors(version).items()}
    write_safetensors(path, tensors, _header(version))


def _read_safetensors(path: Path) -> Any:
    return {k: v.tolist() for k, v in load_file(path).items()}, read_header(path)


WRITERS: dict[str, tuple[str, Callable[[Path, str], None], Callable[[Path], Any]]] = {
    "write_parquet": ("t.parquet", _parquet, _read_parquet),
    "parquet_stream": ("t.parquet", _stream, _read_parquet),
    "write_safetensors numpy": ("v.safetensors", _numpy, _read_safetensors),
    "write_safetensors torch": ("v.safetensors", _torch, _read_safetensors),
}


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_every_fault_leaves_the_old_artifact_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, code: int
) -> None:
    name, write, read = WRITERS[writer]
    probe = tmp_path / "probe"
    probe.mkdir()
    n = count_calls(lambda: write(probe / name, "probe"), monkeypatch)
    assert n >= 4, n  # writes of the file itself, its fsync, the rename, the folder's fsync
    new = read(probe / name)
    for k in range(n):
        for old in ("old", None):
            folder = tmp_path / f"{k}-{old}"
            path = folder / name
            folder.mkdir()
            if old is not None:
                write(path, old)
                before = read(path)
            with failing(monkeypatch, k, code) as seen, pytest.raises(Exception) as raised:
                write(path, "probe")
            if code == errno.ENOSPC:
                assert isinstance(raised.value, DiskFull), (seen, raised.value)
                assert f"{path}: no room for this file" in str(raised.value)
            else:
                assert isinstance(raised.value, OSError), (seen, raised.value)
                assert raised.value.errno == code and raised.value.filename == str(path)
            assert "injected" in str(raised.value)
            renamed = "replace" in seen[:-1]  # the fault hit the folder's fsync, after it
            if renamed:
                assert read(path) == new, seen
            elif old is None:
                assert not path.exists(), seen
            else:
                assert read(path) == before, seen  # the old artifact, whole
            assert not leftovers(folder), seen
