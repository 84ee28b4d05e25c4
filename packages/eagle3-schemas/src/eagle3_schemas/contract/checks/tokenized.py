"""Checks of the tokenized artifact: unique ids, row lengths, a binary loss mask that sums to what
the row says, token ids inside the target's vocabulary.
"""

from __future__ import annotations

import numpy as np
import pyarrow.compute as pc

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.contract.checks.common import (
    MAX_REPORTED,
    capped,
    file_name,
    named,
    unique_ids_in,
)


def symbols(art: Artifact) -> dict[str, int]:
    """Shape symbols fixed by the header."""
    return {"V_target": art.header.fields["vocab_size"]}


def unique_ids(art: Artifact) -> list[Violation]:
    return unique_ids_in(art, "tokenized")


def row_lengths(art: Artifact) -> list[Violation]:
    max_length = art.header.fields["max_length"]
    out, where = [], file_name(art, "tokenized")
    for first, batch in art.batches(
        art.path("tokenized"), ["input_ids", "loss_mask", "num_tokens"]
    ):
        ids_len = pc.list_value_length(batch.column("input_ids")).to_numpy(zero_copy_only=False)
        mask_len = pc.list_value_length(batch.column("loss_mask")).to_numpy(zero_copy_only=False)
        num = batch.column("num_tokens").to_numpy()
        for row in np.flatnonzero(
            (ids_len != mask_len) | (ids_len != num) | (num <= 0) | (num > max_length)
        ):
            found = f"len(input_ids)={ids_len[row]}, len(loss_mask)={mask_len[row]}, num_tokens={num[row]}"
            message = f"{found}: expected all equal and in [1, {max_length}]"
            out.append(Violation(where, f"row {first + row}", message))
    return capped(out)


def loss_mask_binary(art: Artifact) -> list[Violation]:
    out, where, bad_values = [], file_name(art, "tokenized"), set()
    for first, batch in art.batches(art.path("tokenized"), ["loss_mask", "num_loss_tokens"]):
        masks = batch.column("loss_mask")
        flat = pc.list_flatten(masks).to_numpy(zero_copy_only=False)
        bad_values |= set(np.unique(flat[flat > 1]).tolist())
        lengths = pc.list_value_length(masks).to_numpy(zero_copy_only=False)
        rows = np.repeat(np.arange(len(lengths)), lengths)
        sums = np.bincount(rows, weights=flat, minlength=len(lengths)).astype(np.int64)
        declared = batch.column("num_loss_tokens").to_numpy()
        for row in np.flatnonzero(sums != declared):
            message = f"is {declared[row]} but loss_mask sums to {sums[row]}"
            out.append(Violation(where, f"row {first + row}, column num_loss_tokens", message))
    if bad_values:
        message = f"values {sorted(bad_values)[:5]} found, expected only 0 and 1"
        out.insert(0, Violation(where, "column loss_mask", message))
    return capped(out)


def token_ids_in_vocab(art: Artifact) -> list[Violation]:
    vocab = art.header.fields["vocab_size"]
    out, where = [], file_name(art, "tokenized")
    for first, batch in art.batches(art.path("tokenized"), ["input_ids"]):
        ids = batch.column("input_ids")
        flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero((flat < 0) | (flat >= vocab))
        if len(bad):
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            rows = np.repeat(np.arange(len(lengths)), lengths)[bad]
            for row in np.unique(rows)[: MAX_REPORTED + 1]:
                values = flat[bad[rows == row]][:5].tolist()
                message = f"token ids {values} outside [0, {vocab})"
                out.append(Violation(where, f"row {first + row}, column input_ids", message))
    return capped(out)


CHECKS = named(unique_ids, row_lengths, loss_mask_binary, token_ids_in_vocab)
