"""What a test shows of a failed child process: the root cause first (the exception lines
eagle3_schemas.runtime.failures finds in its log), then the tail of the log."""

from __future__ import annotations

from eagle3_schemas.runtime.failures import exception_lines


def failure_report(log: str, tail_chars: int = 3000) -> str:
    """What to show of a failed process: its exception lines, then the tail of its log."""
    causes = exception_lines(log)
    head = "root cause (exception lines of the log):\n" + "\n".join(causes) if causes else ""
    return f"{head}\n--- last {tail_chars} characters of the log ---\n{log[-tail_chars:]}"
