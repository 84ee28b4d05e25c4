"""The acceptance tables of a draft's model card read back as numbers, for the tests that
compare them with eval's report."""

from __future__ import annotations

import json
from typing import Any

from eagle3_schemas.layouts.model_card import _BLOCK, CardError


def read_acceptance(card: str) -> list[dict[str, Any]]:
    """The tables of ``card`` as numbers: each setting with acceptance_length,
    per_position_acceptance, num_drafts, num_prompts (what a test compares with a report)."""
    out = []
    for match in _BLOCK.finditer(card):
        setting = json.loads(match.group(1))
        rows = [
            line
            for line in match.group(0).splitlines()
            if line.startswith("| ") and not line.startswith("| acceptance length")
        ]
        if len(rows) != 1:
            raise CardError(f"acceptance table {setting}: expected one row, found {len(rows)}")
        cells = [c.strip() for c in rows[0].strip("|").split("|")]
        k = setting["k"]
        out.append(
            {
                **setting,
                "acceptance_length": float(cells[0]),
                "per_position_acceptance": [float(c) for c in cells[1 : 1 + k]],
                "num_drafts": int(cells[1 + k]),
                "num_prompts": int(cells[2 + k]),
            }
        )
    return out
