"""Checks of the eval report: acceptance length as 1 + accepted / drafts, per-position rates, and
totals that its sample rows and groups add up to.
"""

from __future__ import annotations

from typing import Any

import pyarrow.compute as pc

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.contract.checks.common import file_name, named


def acceptance_length(art: Artifact) -> list[Violation]:
    f, where, out = art.header.fields, file_name(art, "report"), []
    drafts, accepted = f["num_drafts"], f["num_accepted_tokens"]
    rates, length = f["per_position_acceptance"], f["acceptance_length"]
    if len(rates) != f["num_speculative_tokens"]:
        message = f"has {len(rates)} entries, expected num_speculative_tokens={f['num_speculative_tokens']}"
        out.append(Violation(where, "per_position_acceptance", message))
    expected = 1 + accepted / drafts if drafts else 1.0
    if abs(length - expected) > 1e-6:
        message = f"is {length} but 1 + num_accepted_tokens/num_drafts = {expected:.6f}"
        out.append(Violation(where, "acceptance_length", message))
    if drafts and abs(length - (1 + sum(rates))) > 1e-6:
        message = f"sums to {sum(rates):.6f}, but acceptance_length - 1 = {length - 1:.6f}"
        out.append(Violation(where, "per_position_acceptance", message))
    return out


def sample_totals(art: Artifact) -> list[Violation]:
    f, where, out = art.header.fields, file_name(art, "samples"), []
    t = art.table(art.path("samples"))
    if t.num_rows != f["num_prompts"]:
        message = f"{t.num_rows} rows but the report has num_prompts={f['num_prompts']}"
        out.append(Violation(where, "(rows)", message))
    for column in ("num_drafts", "num_accepted_tokens"):
        total = pc.sum(t.column(column)).as_py() or 0
        if total != f[column]:
            message = f"sums to {total} but the report has {column}={f[column]}"
            out.append(Violation(where, f"column {column}", message))
    return out


def _group_figures(where: str, label: str, group: dict[str, Any], k: int) -> list[Violation]:
    drafts, accepted = group["num_drafts"], group["num_accepted_tokens"]
    expected = 1 + accepted / drafts if drafts else 1.0
    rates = group["per_position_acceptance"]
    out = []
    if len(rates) != k:
        out.append(Violation(where, label, f"{len(rates)} per-position rates for k={k}"))
    if abs(group["acceptance_length"] - expected) > 1e-6 or (
        drafts and abs(group["acceptance_length"] - 1 - sum(rates)) > 1e-6
    ):
        message = (
            f"acceptance_length {group['acceptance_length']} is not 1 + {accepted}/{drafts} "
            "= 1 + sum(per_position_acceptance)"
        )
        out.append(Violation(where, label, message))
    return out


def group_totals(art: Artifact) -> list[Violation]:
    """Each group's counts are the sums of its own sample rows; the sets cover every row."""
    f, where = art.header.fields, file_name(art, "report")
    rows = art.table(art.path("samples")).select(
        ["prompt_set", "category", "num_drafts", "num_accepted_tokens"]
    )
    sums: dict[tuple[str, str | None], list[int]] = {}
    for row in rows.to_pylist():
        keys = [(row["prompt_set"], None)]  # the whole set, and its category when it has one
        if row["category"] is not None:
            keys.append((row["prompt_set"], row["category"]))
        for key in keys:
            total = sums.setdefault(key, [0, 0, 0])
            total[0] += 1
            total[1] += row["num_drafts"]
            total[2] += row["num_accepted_tokens"]
    out: list[Violation] = []
    seen = set()
    for i, group in enumerate(f["groups"]):
        key = (group["prompt_set"], group["category"])
        label = f"groups[{i}] ({key[0]}/{key[1] or '*'})"
        if key in seen:
            out.append(Violation(where, label, "appears twice"))
        seen.add(key)
        found = sums.get(key, [0, 0, 0])
        stated = [group["num_prompts"], group["num_drafts"], group["num_accepted_tokens"]]
        if stated != found:
            message = (
                f"prompts/drafts/accepted {stated} but its samples.parquet rows sum to {found}"
            )
            out.append(Violation(where, label, message))
        out += _group_figures(where, label, group, f["num_speculative_tokens"])
    missing = sorted({s for s, _ in sums} - {s for s, c in seen if c is None})
    if missing:
        out.append(Violation(where, "groups", f"no group for prompt set(s) {missing}"))
    return out


CHECKS = named(acceptance_length, sample_totals, group_totals)
