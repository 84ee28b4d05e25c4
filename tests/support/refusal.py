"""What every stage's argument tests check: a bad argument is refused before any work."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import pytest


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


def refused_before_work_test(
    main: Callable[[Sequence[str]], int],
    cases: Mapping[str, tuple[str, str]],
    first_steps: Sequence[tuple[object, str]],
    message_in: Literal["stderr", "log"],
) -> Callable[..., None]:
    """The test of a stage's bad arguments, one case each: ``cases`` maps a case's name to its
    argv and the message expected (on stderr or in the log), both with ``{placeholders}`` for
    ``{tmp}`` and the paths of the module's ``files`` fixture. Each ``(owner, name)`` of
    ``first_steps`` is a command's first step of real work, patched to fail the test if reached;
    the command must exit 2 within a second, leave the tree as it was, and say the message."""

    @pytest.mark.parametrize("case", cases)
    def test(
        case: str,
        tmp_path: Path,
        files: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        for owner, name in first_steps:
            monkeypatch.setattr(owner, name, work_started)
        argv, message = cases[case]
        names = {"tmp": tmp_path, **files}
        assert_refused_before_work(main, argv.format(**names).split(), tmp_path)
        said = capsys.readouterr().err if message_in == "stderr" else caplog.text
        assert message.format(**names) in said

    return test
