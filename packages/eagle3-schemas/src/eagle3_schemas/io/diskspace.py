"""A full disk as a named stop: before a large write the free space is compared with what it
needs; a write that still hits ENOSPC is reported with the path, what was needed and what was
free. The writers are atomic (eagle3_schemas.io.atomic), so nothing half-written looks whole, and
the stages resume once space is freed."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

# every stage's exit status for "stopped on a full disk; free space and rerun to resume"
EXIT_DISK_FULL = 7
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class DiskFull(RuntimeError):
    """A write does not fit (or did not fit) on its filesystem; the message says where.

    ``path`` and ``cause`` (the system's words) are set by ``disk_full``, so a caller that adds
    its own context names the file that hit the full disk without repeating the whole message.
    """

    def __init__(self, message: str, path: str | Path | None = None, cause: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.cause = cause


def free_bytes(path: str | Path) -> int:
    """Free bytes (for this user) on the filesystem that holds ``path`` (or its nearest
    existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


# how writers that are not Python's own I/O (safetensors' Rust writer) word the same errors
_DISK_FULL_TEXTS = (
    *(f"(os error {n})" for n in DISK_FULL_ERRNOS),
    "No space left on device",
    "Disk quota exceeded",
)


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC / EDQUOT / EFBIG, raised by Python's I/O or reported by a native writer
    (safetensors raises SafetensorError "... No space left on device (os error 28)")."""
    if isinstance(error, DiskFull):
        return True
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno in DISK_FULL_ERRNOS
    return any(text in str(error) for text in _DISK_FULL_TEXTS)


def _mib(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n} bytes)"
    return f"{n} bytes"


def disk_full(
    path: str | Path, what: str, needed: int | None, error: BaseException | None = None
) -> DiskFull:
    """The error to raise: names the path, what was written, what it needed, what is free."""
    free = free_bytes(path)
    need = f"needs about {_mib(needed)}" if needed is not None else "needs more"
    words = ""
    if isinstance(error, DiskFull):
        words = error.cause
    elif isinstance(error, OSError) and error.strerror:
        words = error.strerror
    elif error is not None:
        words = str(error)
    cause = f" ({words})" if words else ""
    if isinstance(error, DiskFull) and error.path is not None and str(error.path) != str(path):
        cause = f" (writing {error.path}{': ' + words if words else ''})"
    return DiskFull(
        f"{path}: no room for {what}{cause}: it {need}, {_mib(free)} free on that filesystem. "
        "Nothing half-written was kept; free space (or point the output elsewhere) and rerun "
        "the same command to resume",
        path,
        words,
    )


def check_free(path: str | Path, what: str, needed: int) -> None:
    """Raise DiskFull before writing ``what`` (about ``needed`` bytes) under ``path``."""
    if free_bytes(path) < needed:
        raise disk_full(path, what, needed)
