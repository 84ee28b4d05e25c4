"""The regenerate journal: one JSON line per finished sample, what makes a run resumable.

Appended as each answer arrives and read back by sample id. A line is written straight to the
file (no buffer that a later flush could retry), so a line cut short by a kill or a full disk is
the file's last and is ignored on reading; the next run drops it before appending. A full disk
stops the run by name (``DiskFull``, exit 7) with every complete line kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import Any

from eagle3_schemas.diskspace import disk_full, is_disk_full

log = logging.getLogger(__name__)


def read_journal(path: Path) -> dict[str, int]:
    """Sample id → byte offset of its journal line. A torn last line (killed writer) is ignored."""
    offsets: dict[str, int] = {}
    if not path.exists():
        return offsets
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            with contextlib.suppress(json.JSONDecodeError, KeyError, UnicodeDecodeError):
                offsets[json.loads(line)["id"]] = offset
            offset += len(line)
    return offsets


def truncate_torn_tail(path: Path) -> None:
    """Drop a partial last line so appended entries start on a fresh line."""
    if path.exists() and path.stat().st_size:
        data = path.read_bytes()
        if not data.endswith(b"\n"):
            log.warning(
                "%s: dropping a torn last line (%d bytes)", path, len(data) - data.rfind(b"\n") - 1
            )
            path.write_bytes(data[: data.rfind(b"\n") + 1])


class Journal:
    """Appends entries to the journal at ``path``; a full disk raises ``DiskFull`` naming it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def done(self, sample_id: str, messages: list[dict[str, str]]) -> None:
        self._append({"id": sample_id, "messages": messages}, sample_id)

    def rejected(self, sample_id: str, reason: str) -> None:
        self._append({"id": sample_id, "rejected": reason}, sample_id)

    def _append(self, entry: dict[str, Any], sample_id: str) -> None:
        line = (json.dumps(entry, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(line)
        try:
            while view:  # a short write (the disk filling up) is followed by the error itself
                view = view[os.write(self._fd, view) :]
        except OSError as e:
            if not is_disk_full(e):
                raise
            raise disk_full(
                self.path, f"the journal entry of sample {sample_id!r}", len(line), e
            ) from e

    def __enter__(self) -> Journal:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        os.close(self._fd)
