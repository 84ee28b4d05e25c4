"""Fault injection at I/O: the atomic writers and the journal lines fail their k-th write, fsync
or rename with ENOSPC or EIO, for every k a write makes. Each failure leaves the old artifact
(or none) under the final name, no temporary file, and an error that names the file: DiskFull
for a full disk, the OSError with the file named for another fault.

The faults are injected at the ``os`` functions the writers call (``os.fsync``, ``os.replace``,
``os.rename``, ``os.write``: support.iofaults); the writers themselves run unchanged.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from eagle3_schemas.io.atomic import atomic_directory, write_json_atomic
from eagle3_schemas.io.diskspace import DiskFull
from eagle3_schemas.io.jsonl import append_to, complete_lines

from support.iofaults import count_calls, failing, leftovers


def named(code: int, path: Path) -> tuple[type[Exception], str]:
    """The error a fault of ``code`` at writing ``path`` raises, and what its message holds."""
    if code == errno.ENOSPC:
        return DiskFull, f"{path}: no room for "
    return OSError, str(path)


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
        error, words = named(code, path)
        with failing(monkeypatch, k, code) as seen, pytest.raises(error) as raised:
            write_json_atomic(path, {"v": "new"})
        assert words in str(raised.value) and "injected" in str(raised.value)
        after_rename = "replace" in seen[:-1]  # the fault hit the directory's fsync
        assert json.loads(path.read_text()) == {"v": "new" if after_rename else "old"}, seen
        assert not leftovers(tmp_path), seen


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_atomic_directory_every_fault_leaves_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def write(final: Path) -> None:
        with atomic_directory(final) as tmp:
            (tmp / "a.json").write_text("{}")

    with failing(monkeypatch, -1, code) as order:
        write(tmp_path / "probe")
    # the file's data, then the folder's entries, on disk before the folder has its name
    assert order == ["fsync", "fsync", "rename", "fsync"]
    n = count_calls(lambda: write(tmp_path / "probe2"), monkeypatch)
    for k in range(n):
        final = tmp_path / f"out{k}"
        error, words = named(code, final)
        with failing(monkeypatch, k, code) as seen, pytest.raises(error, match=words):
            write(final)
        renamed = "rename" in seen[:-1]
        assert final.is_dir() == renamed, seen
        if renamed:
            assert (final / "a.json").read_text() == "{}"
        assert not leftovers(tmp_path), seen


def test_journal_line_every_fault_keeps_complete_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at a journal line is DiskFull naming the file; an I/O error is the OSError
    naming the file; either way the lines before it are intact and the torn line is never read
    back."""
    path = tmp_path / "journal.jsonl"
    for code, named in ((errno.ENOSPC, DiskFull), (errno.EIO, OSError)):
        path.unlink(missing_ok=True)
        append_to(path, b'{"row": 0}\n', "a journal row")
        n = count_calls(lambda: append_to(tmp_path / "probe.jsonl", b"{}\n", "x"), monkeypatch)
        for k in range(n):
            with failing(monkeypatch, k, code), pytest.raises(named) as raised:
                append_to(path, b'{"row": 1}\n', "a journal row")
            assert str(path) in str(raised.value) and "a journal row" in str(raised.value)
            assert complete_lines(path) == [b'{"row": 0}']
