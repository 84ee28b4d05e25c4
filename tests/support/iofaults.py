"""Fault injection at I/O for the writers' tests: the k-th write, fsync or rename a block of code
makes fails with an errno (ENOSPC, EIO), for every k it makes.

Counted in one sequence: the ``os`` functions the writers call (``os.fsync``, ``os.replace``,
``os.rename``, ``os.write``); every write pyarrow's Parquet writers make (``pq.write_table`` and
``pq.ParquetWriter`` are given a Python file over the same path, so each of their writes passes
here); files a module given in ``opens`` opens with ``"wb"`` (each of their writes); and
safetensors' ``save_file`` (numpy and torch), serialized by safetensors itself and
written in chunks, whose failure is raised as the Rust writer raises it (``SafetensorError``
"... (os error N)"). The writers under test run unchanged.
"""

from __future__ import annotations

import builtins
import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import pyarrow.parquet as pq
import pytest
import safetensors.numpy
import safetensors.torch
from safetensors import SafetensorError

from eagle3_schemas.io.atomic import TEMP_MARKER

OS_CALLS = ("fsync", "replace", "rename", "write")
CHUNK = 256  # bytes per write of the safetensors stand-in: a tiny file takes a few


class _Faults:
    def __init__(self, k: int, code: int) -> None:
        self.k, self.code = k, code
        self.seen: list[str] = []

    def hit(self, name: str) -> None:
        """Count a call to ``name``; raise the injected OSError when it is the k-th."""
        self.seen.append(name)
        if len(self.seen) - 1 == self.k:
            raise OSError(self.code, f"{os.strerror(self.code)} (injected at {name} #{self.k})")


class _File(io.RawIOBase):
    """A file opened for writing whose every write is counted (pyarrow writes through it)."""

    def __init__(self, path: str | os.PathLike[str], faults: _Faults, name: str) -> None:
        self._f = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
        self._faults, self._name = faults, name

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._faults.hit(self._name)
        return self._f.write(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def _parquet(m: pytest.MonkeyPatch, faults: _Faults) -> None:
    write_table, writer_class = pq.write_table, pq.ParquetWriter

    def write(table: Any, where: Any, *args: Any, **kwargs: Any) -> None:
        with _File(where, faults, "parquet write") as f:
            write_table(table, f, *args, **kwargs)

    class Writer(writer_class):  # type: ignore[misc, valid-type]
        def __init__(self, where: Any, *args: Any, **kwargs: Any) -> None:
            self._sink = _File(where, faults, "parquet write")
            super().__init__(self._sink, *args, **kwargs)

        def close(self) -> None:
            try:
                super().close()
            finally:
                self._sink.close()

    m.setattr(pq, "write_table", write)
    m.setattr(pq, "ParquetWriter", Writer)


def _safetensors(m: pytest.MonkeyPatch, faults: _Faults) -> None:
    for module in (safetensors.numpy, safetensors.torch):

        def save_file(
            tensors: Any, filename: Any, metadata: Any = None, _save: Any = module.save
        ) -> None:
            data = _save(tensors, metadata=metadata)
            with open(filename, "wb", buffering=0) as f:
                for start in range(0, len(data), CHUNK):
                    try:
                        faults.hit("safetensors write")
                    except OSError as e:  # as safetensors' Rust writer reports it
                        raise SafetensorError(
                            f"Error while serializing: I/O error: {e.strerror} (os error {e.errno})"
                        ) from None
                    f.write(data[start : start + CHUNK])

        m.setattr(module, "save_file", save_file)


def _opens(m: pytest.MonkeyPatch, faults: _Faults, modules: tuple[ModuleType, ...]) -> None:
    """Files these modules open for binary writing ("wb") count each of their writes."""

    def counted(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if mode == "wb":
            return _File(file, faults, "file write")
        return builtins.open(file, mode, *args, **kwargs)

    for module in modules:
        m.setattr(module, "open", counted, raising=False)


@contextmanager
def failing(
    monkeypatch: pytest.MonkeyPatch, k: int, code: int, opens: tuple[ModuleType, ...] = ()
) -> Iterator[list[str]]:
    """Count every write, fsync and rename inside the block; the ``k``-th (0-based) fails with
    ``code`` (k = -1: none fails). ``opens``: modules whose own ``open(..., "wb")`` files are
    counted too (a writer serializing by hand). Yields the names of the calls made, in order."""
    faults = _Faults(k, code)
    originals = {name: getattr(os, name) for name in OS_CALLS}

    def wrap(name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            faults.hit(name)
            return originals[name](*args, **kwargs)

        return call

    with monkeypatch.context() as m:
        for name in OS_CALLS:
            m.setattr(os, name, wrap(name))
        _parquet(m, faults)
        _safetensors(m, faults)
        _opens(m, faults, opens)
        yield faults.seen


def count_calls(
    write: Callable[[], object],
    monkeypatch: pytest.MonkeyPatch,
    opens: tuple[ModuleType, ...] = (),
) -> int:
    """How many counted calls ``write`` makes when none fails."""
    with failing(monkeypatch, -1, 0, opens) as seen:
        write()
    return len(seen)


def leftovers(directory: Path) -> list[str]:
    """Temporary names the atomic writers left in ``directory`` (none, after any failure)."""
    return [p.name for p in directory.rglob("*") if TEMP_MARKER in p.name]
