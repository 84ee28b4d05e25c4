"""Running a stage's console-script entry point inside the test process (imports paid once),
with its exit code, stdout and log records: shared by the recipe tests."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

from support.train import train_in_process


@dataclass
class Outcome:
    code: int
    stdout: str  # a stage's result (eagle3-data: one JSON summary; extract preflight: findings)
    log: str  # stderr and log records: usage errors, the preflight reports of run and train

    def summary(self) -> dict:
        return json.loads(self.stdout.strip().splitlines()[-1])


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def run_cli(main: Callable[[list[str] | None], int], argv: list[str]) -> Outcome:
    """A stage's console-script entry point, called in this process (imports are paid once)."""
    records, root = _Records(), logging.getLogger()
    stdout, stderr = io.StringIO(), io.StringIO()
    level = root.level
    root.addHandler(records)
    root.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(argv)
    finally:
        root.removeHandler(records)
        root.setLevel(level)
    return Outcome(code, stdout.getvalue(), "\n".join([stderr.getvalue(), *records.lines]))


def run_train_cli(argv: list[str]) -> Outcome:
    """eagle3-train in this process; its global state (threads, Accelerate) undone after."""
    return run_cli(train_in_process, argv)
