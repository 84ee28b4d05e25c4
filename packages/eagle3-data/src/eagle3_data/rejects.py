"""The rejects file: every record a command refused, with where it came from and why.

JSONL, one object per rejected record: ``source`` (file:record), ``reason`` and ``record``
(the raw text, or the normalised messages), so nothing is lost and every refusal is explained.
Written to a temporary name, flushed to disk and renamed when the command ends; a full disk
stops the command by name (``DiskFull``, exit 7) and leaves the previous rejects file, if any.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

from eagle3_schemas.io.atomic import TEMP_MARKER
from eagle3_schemas.io.diskspace import disk_full, is_disk_full


class RejectsFile(contextlib.AbstractContextManager["RejectsFile"]):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.reasons: Counter[str] = Counter()
        self._tmp = path.with_name(f"{path.name}{TEMP_MARKER}{os.getpid()}")
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self._tmp, "w", encoding="utf-8")  # noqa: SIM115 - closed in __exit__

    def add(self, source: str, reason: str, record: Any) -> None:
        """Keep one rejected record. ``reason`` starts with a short class name before ':'."""
        self.reasons[reason.split(":", 1)[0]] += 1
        line = json.dumps(
            {"source": source, "reason": reason, "record": record},
            ensure_ascii=False,
            default=repr,  # a table's bytes, dates or decimals, kept readable
        )
        try:
            self._file.write(line + "\n")
        except OSError as e:
            raise self._named(e) from e

    def _named(self, error: OSError) -> Exception:
        if is_disk_full(error):
            return disk_full(self.path, "the rejected records", None, error)
        return OSError(error.errno, f"{error.strerror or error} (the rejects file)", str(self.path))

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        try:
            if exc_type is None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                os.replace(self._tmp, self.path)
                return
        except OSError as e:
            self._discard()
            raise self._named(e) from e
        # the command failed (a full disk, maybe): what the buffer still holds is dropped
        # with the file, and a second error from flushing it would hide the first
        self._discard()

    def _discard(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()
        self._tmp.unlink(missing_ok=True)
