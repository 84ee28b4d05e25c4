"""The root cause of a failed child process, read from its log.

A vLLM engine that fails to start prints the real reason (``ValueError: Available memory on node
0 ...``) in its engine-core process, then the parent adds a generic ``RuntimeError: Engine core
initialization failed. See root cause above.`` and a long traceback of its own: the last lines of
a log name the symptom, not the cause. Stages and tests that report a child's failure lead with
every exception line the log holds.
"""

from __future__ import annotations

import re

# "ValueError: ...", "(EngineCore_DP0 pid=12) torch.OutOfMemoryError: ...", "KeyError: 'x'"
EXCEPTION_LINE = re.compile(r"\b[\w.]*(?:Error|Exception|Interrupt|Exit)\b: \S")
MAX_LINES = 8


def exception_lines(log: str) -> list[str]:
    """The log's exception lines, first occurrence each, in order (at most the last 8)."""
    seen: dict[str, None] = {}
    for line in log.splitlines():
        if EXCEPTION_LINE.search(line):
            seen.setdefault(line.strip(), None)
    return list(seen)[-MAX_LINES:]
