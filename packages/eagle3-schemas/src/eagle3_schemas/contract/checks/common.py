"""What the checks of several artifact kinds share: the cap on reported violations, where a
file is named, duplicate ids, and the vocabulary map's rules (a vocab map and a draft checkpoint
both hold d2t and t2d).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from eagle3_schemas.contract.artifact import Artifact, Violation

Check = Callable[[Artifact], list[Violation]]
MAX_REPORTED = 5  # per check, so a fully corrupt file does not print millions of lines


def capped(violations: list[Violation]) -> list[Violation]:
    if len(violations) <= MAX_REPORTED:
        return violations
    first = violations[0]
    return [
        *violations[:MAX_REPORTED],
        Violation(
            first.file, first.location, f"... and {len(violations) - MAX_REPORTED} more like these"
        ),
    ]


def named(*checks: Check) -> dict[str, Check]:
    """A kind's ``CHECKS``: each check under its function's name, the name schema files use."""
    return {check.__name__: check for check in checks}


def file_name(art: Artifact, role: str) -> str:
    return art.rel(art.path(role))


def duplicates(
    where: str, rows: Iterable[tuple[int, str]], column: str, noun: str
) -> list[Violation]:
    """A violation per (row, value) whose value an earlier row already holds."""
    seen: dict[str, int] = {}
    out = []
    for row, value in rows:
        if value in seen:
            message = f"duplicate {noun} {value!r} (first at row {seen[value]})"
            out.append(Violation(where, f"row {row}, column {column}", message))
        seen.setdefault(value, row)
    return capped(out)


def unique_ids_in(art: Artifact, role: str) -> list[Violation]:
    batches = art.batches(art.path(role), ["id"])
    rows = (
        (first + i, v) for first, b in batches for i, v in enumerate(b.column("id").to_pylist())
    )
    return duplicates(file_name(art, role), rows, "id", "id")


def d2t_offset_violations(where: str, d2t: np.ndarray, v_target: int) -> list[Violation]:
    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t
    out = []
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= v_target))
    for i in bad[:MAX_REPORTED]:
        message = f"maps draft id {i} to target id {target_ids[i]}, outside [0, {v_target}) (d2t holds offsets: target = i + d2t[i])"
        out.append(Violation(where, f"tensor d2t[{i}]", message))
    unsorted = np.flatnonzero(np.diff(target_ids) <= 0)
    for i in unsorted[:MAX_REPORTED]:
        message = f"target id {target_ids[i + 1]} does not exceed draft id {i}'s {target_ids[i]} (draft ids must be sorted ascending by target id, no repeats)"
        out.append(Violation(where, f"tensor d2t[{i + 1}]", message))
    return capped(out)


def t2d_violations(where: str, d2t: np.ndarray, t2d: np.ndarray) -> list[Violation]:
    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t
    expected = np.zeros(len(t2d), dtype=bool)
    expected[target_ids[(target_ids >= 0) & (target_ids < len(t2d))]] = True
    diff = np.flatnonzero(expected != t2d)
    return capped(
        [
            Violation(
                where,
                f"tensor t2d[{i}]",
                f"is {bool(t2d[i])} but target id {i} is {'' if expected[i] else 'not '}in d2t's draft vocabulary",
            )
            for i in diff[: MAX_REPORTED + 1]
        ]
    )
