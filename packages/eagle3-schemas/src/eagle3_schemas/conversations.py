"""Contract of the conversations artifact shared by its writers and readers: roles, ids, and
the seeded selection of samples by id that every stage taking a subset uses."""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Mapping, Sequence
from typing import Any

from eagle3_schemas.fingerprint import canonical_json

ROLES = ("system", "user", "assistant")


def conversation_id(messages: Sequence[Mapping[str, Any]]) -> str:
    """The stable content id: sha256 of the canonical JSON of [{role, content}, ...], 32 hex."""
    normalised = [{"role": m["role"], "content": m["content"]} for m in messages]
    return hashlib.sha256(canonical_json(normalised)).hexdigest()[:32]


def conversation_problem(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """Why ``messages`` breaks the role convention, or None.

    The message starts with a short class (``unknown_role``, ``empty_turn``,
    ``not_alternating``, ``no_assistant``) before a colon, for counting rejects by kind.
    """
    if not messages:
        return "empty_turn: no messages"
    roles = [m.get("role") for m in messages]
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            return f"unknown_role: message {i}: role {m.get('role')!r} (expected system, user or assistant)"
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            return f"empty_turn: message {i} ({m.get('role')}) has empty content"
    offset = 1 if roles[0] == "system" else 0
    turns = roles[offset:]
    if "system" in turns:
        return f"not_alternating: message {roles.index('system', 1)}: a system message is allowed only first"
    for i, role in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if role != want:
            return f"not_alternating: message {i + offset}: role {role!r} where {want!r} was expected (user and assistant alternate, user first)"
    if "assistant" not in turns:
        return "no_assistant: no assistant turn"
    return None


def select_rows(
    ids: Sequence[str], max_samples: int | None, sample_seed: int | None = None
) -> list[int]:
    """The rows a stage takes, in file order: all, the first ``max_samples``, or (with
    ``sample_seed``) ``max_samples`` rows drawn at random.

    The draw keeps the rows whose ``blake2b(f"{seed}:{id}")`` is smallest: the same seed picks
    the same samples on any machine and numpy version, and whatever the file's row order.
    """
    count = len(ids) if max_samples is None else min(max_samples, len(ids))
    if sample_seed is None:
        return list(range(count))
    keys = (
        (hashlib.blake2b(f"{sample_seed}:{sample_id}".encode(), digest_size=8).digest(), row)
        for row, sample_id in enumerate(ids)
    )
    return sorted(row for _, row in heapq.nsmallest(count, keys))


def describe_selection(max_samples: int | None, sample_seed: int | None) -> str:
    """How ``select_rows`` chose, in words, for an artifact header."""
    if max_samples is None:
        return "all rows"
    if sample_seed is None:
        return f"the first {max_samples} rows"
    return (
        f"{max_samples} rows at random: the smallest blake2b('{sample_seed}:' + id) "
        "(8-byte digest), kept in file order"
    )
