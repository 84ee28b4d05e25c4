"""A real small filesystem for full-disk tests: a tmpfs of a given size (needs root, else the
test is skipped with the reason), with a filler file to leave exactly some room."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def small_tmpfs(directory: Path, size_mib: int = 8) -> Iterator[Path]:
    import pytest

    directory.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size_mib} MiB tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def leave_free(directory: Path, free: int, name: str = "filler") -> Path:
    """Fill the filesystem of ``directory`` until about ``free`` bytes are left."""
    import shutil

    filler = directory / name
    filler.unlink(missing_ok=True)
    room = shutil.disk_usage(directory).free - free
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, room))
    return filler
