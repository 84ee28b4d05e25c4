"""The regenerate journal: one JSON line per finished sample, what makes a run resumable.

Appended as each answer arrives and read back by sample id, through eagle3_schemas.io.jsonl: a
line cut short by a kill or a full disk is the file's last and is ignored on reading; the next
run drops it before appending (``truncate_torn_tail``). A full disk stops the run by name
(``DiskFull``, exit 7) with every complete line kept.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from eagle3_schemas.io.jsonl import append_line


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


class Journal(contextlib.AbstractContextManager["Journal"]):
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
        append_line(self._fd, line, self.path, f"the journal entry of sample {sample_id!r}")

    def __exit__(self, *exc_info: object) -> None:
        os.close(self._fd)
