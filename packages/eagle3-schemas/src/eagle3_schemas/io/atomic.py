"""Atomic writes: a crash never leaves a half-written file or directory under the final name.

Everything is written under a temporary name in the same directory (same filesystem), flushed
to disk, then renamed into place; the rename is atomic on POSIX. A write that fails removes the
temporary name and raises an error naming the artifact: ``DiskFull`` (exit 7) for a full disk,
whichever writer hit it (Python's, pyarrow's, safetensors' Rust one), else the OSError with the
file named.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from eagle3_schemas.io.diskspace import DiskFull, disk_full, is_disk_full

TEMP_MARKER = ".eagle3-tmp-"
# how a native writer (safetensors' Rust one) words an OS error: "... (os error 5)"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _raise_named(error: BaseException, final: Path) -> NoReturn:
    """Raise what ``error`` from writing ``final`` stands for: a full disk as ``DiskFull``, an
    OS error (Python's, or a native writer's in its words) with ``final`` named; else ``error``
    as it is (it is not about the disk, or already names what it is about)."""
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: as they are
        raise error
    if isinstance(error, DiskFull):  # named by the writer inside
        raise error
    if is_disk_full(error):
        raise disk_full(final, "this file", None, error) from error
    if isinstance(error, OSError):
        if error.filename is not None or error.errno is None:
            raise error
        raise OSError(error.errno, error.strerror or str(error), str(final)) from error
    found = _OS_ERROR.search(str(error))
    if found is not None:
        raise OSError(int(found.group(1)), str(error), str(final)) from error
    raise error


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename into it, a file created in it) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: Path) -> None:
    """Every file under ``directory``, then its directories deepest first, flushed to disk: what
    a library wrote there without fsync is on disk before the tree is renamed into place."""
    for path in sorted(directory.rglob("*")):
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
        fsync_dir(path)
    fsync_dir(directory)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on clean exit fsync it and rename it to ``final``.

    The caller writes the whole file to the yielded path (with any writer: pyarrow,
    safetensors, plain ``open``). On an exception the temporary file is removed.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f"{final.name}{TEMP_MARKER}", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        _raise_named(e, final)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary directory beside ``final``; on clean exit rename it to ``final``.

    ``final`` must not exist yet: replacing a directory is not atomic, so an existing
    artifact is never overwritten silently.
    """
    final = Path(final)
    if final.exists():
        raise FileExistsError(
            f"{final}: already exists; refusing to overwrite an artifact directory"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}{TEMP_MARKER}", dir=final.parent))
    try:
        yield tmp
        fsync_tree(tmp)  # the writers inside (safetensors, pyarrow, json) do not all fsync
        os.rename(tmp, final)
        fsync_dir(final.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_named(e, final)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as indented UTF-8 JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
