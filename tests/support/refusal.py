"""What every stage's argument tests check: a bad argument is refused before any work."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path


def work_started(*args: object, **kwargs: object) -> None:
    """Patched over a command's first step of real work: reaching it fails the test."""
    raise AssertionError("the command started working on a bad argument")


def assert_refused_before_work(
    main: Callable[[Sequence[str]], int], argv: list[str], root: Path
) -> None:
    """``main(argv)`` exits 2 within a second and leaves the tree under ``root`` as it was
    (no output, rejects, journal, work directory or temp file). The caller checks the message."""
    before = sorted(root.rglob("*"))
    started = time.perf_counter()
    code = main(argv)
    assert time.perf_counter() - started < 1.0
    assert code == 2
    assert sorted(root.rglob("*")) == before
