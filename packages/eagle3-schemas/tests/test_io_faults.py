"""Fault injection at I/O: the atomic writers and the journal lines fail their k-th write, fsync
or rename with ENOSPC or EIO, for every k a write makes. Each failure leaves the old artifact
(or none) under the final name, no temporary file, and an error that names the failure.

The faults are injected at the ``os`` functions the writers call (``os.fsync``, ``os.replace``,
``os.rename``, ``os.write``); the writers themselves run unchanged.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from eagle3_schemas.io.atomic import TEMP_MARKER, atomic_directory, write_json_atomic
from eagle3_schemas.io.diskspace import DiskFull
from eagle3_schemas.io.jsonl import append_to, complete_lines

CALLS = ("fsync", "replace", "rename", "write")


class Injected(Exception):
    pass


@contextmanager
def failing(monkeypatch: pytest.MonkeyPatch, k: int, code: int) -> Iterator[list[str]]:
    """Every call to the ``os`` functions of ``CALLS`` counted; the ``k``-th (0-based) raises
    OSError(``code``). Yields the names of the calls made, in order."""
    seen: list[str] = []
    originals = {name: getattr(os, name) for name in CALLS}

    def wrap(name: str) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            seen.append(name)
            if len(seen) - 1 == k:
                raise OSError(code, f"{os.strerror(code)} (injected at {name} #{k})")
            return originals[name](*args, **kwargs)

        return call

    with monkeypatch.context() as m:
        for name in CALLS:
            m.setattr(os, name, wrap(name))
        yield seen


def _calls(write: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> int:
    with failing(monkeypatch, -1, errno.EIO) as seen:
        write()
    return len(seen)


def _leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if TEMP_MARKER in p.name]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_write_json_atomic_every_fault_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    path = tmp_path / "report.json"
    with failing(monkeypatch, -1, code) as order:
        write_json_atomic(tmp_path / "probe.json", {"v": 0})
    assert order == ["fsync", "replace", "fsync"]  # the file's data on disk before its name
    n = len(order)
    for k in range(n):
        write_json_atomic(path, {"v": "old"})
        with failing(monkeypatch, k, code) as seen, pytest.raises(OSError) as raised:
            write_json_atomic(path, {"v": "new"})
        assert raised.value.errno == code and "injected" in str(raised.value)
        after_rename = "replace" in seen[:-1]  # the fault hit the directory's fsync
        assert json.loads(path.read_text()) == {"v": "new" if after_rename else "old"}, seen
        assert not _leftovers(tmp_path), seen


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_atomic_directory_every_fault_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def write(final: Path) -> None:
        with atomic_directory(final) as tmp:
            (tmp / "a.json").write_text("{}")

    n = _calls(lambda: write(tmp_path / "probe"), monkeypatch)
    for k in range(n):
        final = tmp_path / f"out{k}"
        with failing(monkeypatch, k, code) as seen, pytest.raises(OSError):
            write(final)
        renamed = "rename" in seen[:-1]
        assert final.is_dir() == renamed, seen
        if renamed:
            assert (final / "a.json").read_text() == "{}"
        assert not _leftovers(tmp_path), seen


def test_journal_line_every_fault_keeps_complete_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at a journal line is DiskFull naming the file; an I/O error is raised as is;
    either way the lines before it are intact and the torn line is never read back."""
    path = tmp_path / "journal.jsonl"
    for code, named in ((errno.ENOSPC, DiskFull), (errno.EIO, OSError)):
        path.unlink(missing_ok=True)
        append_to(path, b'{"row": 0}\n', "a journal row")
        n = _calls(lambda: append_to(tmp_path / "probe.jsonl", b"{}\n", "x"), monkeypatch)
        for k in range(n):
            with failing(monkeypatch, k, code), pytest.raises(named) as raised:
                append_to(path, b'{"row": 1}\n', "a journal row")
            assert str(path) in str(raised.value) or raised.value.errno == code
            assert complete_lines(path) == [b'{"row": 0}']
