"""Append-only JSON-lines files that a kill or a full disk may cut short (regenerate's journal,
the trainer's metrics.jsonl).

Each line is written straight to the file (no buffer that a later flush could retry), so a
line cut short can only be the file's last. A full disk stops the writer by name
(``DiskFull``, exit 7) with every complete line kept (another I/O error names the file too);
readers take complete lines only, and the next writer drops the torn tail before appending.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from eagle3_schemas.io.diskspace import disk_full, is_disk_full

log = logging.getLogger(__name__)


def append_line(fd: int, line: bytes, path: Path, what: str) -> None:
    """Write ``line`` to ``fd`` (opened with O_APPEND on ``path``); a full disk raises
    ``DiskFull`` naming ``path`` and ``what`` the line holds."""
    view = memoryview(line)
    try:
        while view:  # a short write (the disk filling up) is followed by the error itself
            view = view[os.write(fd, view) :]
    except OSError as e:
        if is_disk_full(e):
            raise disk_full(path, what, len(line), e) from e
        raise OSError(e.errno, f"{e.strerror or e} (writing {what})", str(path)) from e


def append_to(path: Path, line: bytes, what: str) -> None:
    """``append_line`` to the file at ``path`` (created if missing), opened for this line."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        append_line(fd, line, path, what)
    finally:
        os.close(fd)


def complete_lines(path: Path) -> list[bytes]:
    """The lines of ``path`` that end in a newline: a torn last line (a writer killed or out
    of room mid-line, or one still writing) is left out."""
    data = path.read_bytes()
    return data[: data.rfind(b"\n") + 1].splitlines()


def truncate_torn_tail(path: Path) -> None:
    """Drop a partial last line so appended entries start on a fresh line (cut in place: the
    complete lines are never rewritten)."""
    if path.exists() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            log.warning("%s: dropping a torn last line (%d bytes)", path, len(data) - keep)
            os.truncate(path, keep)
