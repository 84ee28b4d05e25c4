"""The named semantic checks that the schema files declare, one module per artifact kind.

Each check takes the structurally valid ``Artifact`` and returns its violations. Each kind's
module holds its ``CHECKS`` (the names its schema file declares, each with its function) and,
where the header fixes tensor shapes, its ``symbols``; ``common`` holds what several kinds share.
The meta-check fails when a schema declares a check missing here, or the reverse.
"""

from __future__ import annotations

from eagle3_schemas.contract.artifact import Artifact
from eagle3_schemas.contract.checks import (
    conversations,
    draft_checkpoint,
    eval_report,
    hidden_states,
    tokenized,
    vocab_map,
)
from eagle3_schemas.contract.checks.common import Check

CHECKS: dict[str, dict[str, Check]] = {
    "conversations": conversations.CHECKS,
    "tokenized": tokenized.CHECKS,
    "vocab_map": vocab_map.CHECKS,
    "hidden_states": hidden_states.CHECKS,
    "draft_checkpoint": draft_checkpoint.CHECKS,
    "eval_report": eval_report.CHECKS,
}

# Checks that read every stored value; validate(deep=False) skips them.
DEEP_CHECKS = {"row_checksums", "finite"}

# The shape symbols an artifact's header (or config) fixes, by kind.
SYMBOLS = {
    "tokenized": tokenized.symbols,
    "vocab_map": vocab_map.symbols,
    "hidden_states": hidden_states.symbols,
    "draft_checkpoint": draft_checkpoint.symbols,
}


def symbols_from_header(art: Artifact) -> dict[str, int]:
    """Shape symbols fixed by the header (or config), before any tensor is read."""
    return SYMBOLS[art.kind](art) if art.kind in SYMBOLS else {}
