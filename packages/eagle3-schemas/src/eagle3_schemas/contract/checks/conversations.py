"""Checks of the conversations artifact: unique ids, the role rules of its schema version, declared
tools and the mode.
"""

from __future__ import annotations

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.contract.checks.common import capped, file_name, named, unique_ids_in
from eagle3_schemas.layouts.conversations import MODES, conversation_problem, tools_problem


def unique_ids(art: Artifact) -> list[Violation]:
    return unique_ids_in(art, "conversations")


def roles_alternate(art: Artifact) -> list[Violation]:
    out, where = [], file_name(art, "conversations")
    for first, batch in art.batches(art.path("conversations"), ["messages"]):
        for offset, messages in enumerate(batch.column("messages").to_pylist()):
            problem = conversation_problem(messages, art.header.schema_version)
            if problem:
                out.append(Violation(where, f"row {first + offset}, column messages", problem))
    return capped(out)


def tools_and_mode(art: Artifact) -> list[Violation]:
    out, where = [], file_name(art, "conversations")
    for first, batch in art.batches(art.path("conversations"), ["tools", "mode"]):
        d = batch.to_pydict()
        for offset, (tools, mode) in enumerate(zip(d["tools"], d["mode"], strict=True)):
            row = first + offset
            problem = tools_problem(tools)
            if problem:
                out.append(Violation(where, f"row {row}, column tools", problem))
            if mode not in MODES:
                expected = f"{mode!r} (expected one of {list(MODES)})"
                out.append(Violation(where, f"row {row}, column mode", expected))
    return capped(out)


CHECKS = named(unique_ids, roles_alternate, tools_and_mode)
