"""Checks of the vocabulary map: d2t offsets and t2d agree, counts add up to the header's totals
and coverage.
"""

from __future__ import annotations

import numpy as np

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.contract.checks.common import d2t_offset_violations, named, t2d_violations


def symbols(art: Artifact) -> dict[str, int]:
    """Shape symbols fixed by the header."""
    f = art.header.fields
    return {"V_target": f["target_vocab_size"], "V_draft": f["draft_vocab_size"]}


def d2t_offsets(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("vocab_map"))
    return d2t_offset_violations(str(art.root), st.array("d2t"), st.tensors["t2d"].shape[0])


def t2d_matches_d2t(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("vocab_map"))
    return t2d_violations(str(art.root), st.array("d2t"), st.array("t2d"))


def counts_nonnegative(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("vocab_map"))
    counts, d2t = st.array("token_counts"), st.array("d2t")
    f, where, out = art.header.fields, str(art.root), []
    if np.any(counts < 0):
        message = f"{int(np.count_nonzero(counts < 0))} negative counts"
        out.append(Violation(where, "tensor token_counts", message))
    if int(counts.sum()) != f["num_loss_tokens"]:
        message = f"is {f['num_loss_tokens']} but token_counts sum to {int(counts.sum())}"
        out.append(Violation(where, "header.num_loss_tokens", message))
    total = max(int(counts.sum()), 1)
    covered = int(counts[np.arange(len(d2t)) + d2t].sum()) / total
    if abs(covered - f["coverage"]) > 1e-6:
        message = f"is {f['coverage']} but the draft vocabulary covers {covered:.6f} of loss tokens"
        out.append(Violation(where, "header.coverage", message))
    return out


CHECKS = named(d2t_offsets, t2d_matches_d2t, counts_nonnegative)
