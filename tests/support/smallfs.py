"""A real small filesystem for full-disk tests: a tmpfs of a given size (needs root, else the
test is skipped with the reason, which fails CI's required ``tmpfs`` tier), with a filler file
to leave exactly some room."""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _mount(directory: Path, size_mib: int) -> str | None:
    """Mount a tmpfs of ``size_mib`` MiB on ``directory``; None, or why it could not."""
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode == 0:
        return None
    return f"cannot mount a {size_mib} MiB tmpfs (needs root): {mounted.stderr.strip()}"


def _unmount(directory: Path) -> None:
    subprocess.run(["umount", "-l", str(directory)], check=False)


def tmpfs_problem() -> str | None:
    """Why this machine cannot run the full-disk tests (a trial mount fails), or None."""
    with tempfile.TemporaryDirectory(prefix="eagle3-tmpfs-probe-") as probe:
        problem = _mount(Path(probe), 1)
        if problem is None:
            _unmount(Path(probe))
        return problem


@contextlib.contextmanager
def small_tmpfs(directory: Path, size_mib: int = 8) -> Iterator[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    problem = _mount(directory, size_mib)
    if problem is not None:
        pytest.skip(problem)
    try:
        yield directory
    finally:
        _unmount(directory)


def leave_free(directory: Path, free: int, name: str = "filler") -> Path:
    """Fill the filesystem of ``directory`` until about ``free`` bytes are left (none, where
    a writer beside this one takes some of the room meanwhile: the disk is full either way)."""
    filler = directory / name
    filler.unlink(missing_ok=True)
    data = memoryview(b"\0" * max(0, shutil.disk_usage(directory).free - free))
    with open(filler, "wb", buffering=0) as f:
        try:
            while data:
                data = data[f.write(data) :]
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
    return filler
