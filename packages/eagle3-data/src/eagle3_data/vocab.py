"""vocab: loss-token counts → the draft vocabulary mapping (vLLM / speculators convention).

The draft vocabulary is the ``V_draft`` most frequent loss tokens, ties broken by the lower
id; when fewer distinct tokens occur, the lowest unused ids fill it (as speculators does).
Draft ids are sorted ascending by target id; ``d2t[i] = target_id - i`` and ``t2d`` marks the
chosen target ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eagle3_data.config import VocabConfig
from eagle3_schemas.contract.header import make_header, read_header, write_safetensors
from eagle3_schemas.contract.lineage import fingerprint_artifact


@dataclass(frozen=True)
class VocabMap:
    token_counts: np.ndarray  # int64 [V_target]
    d2t: np.ndarray  # int64 [V_draft]
    t2d: np.ndarray  # bool [V_target]

    @property
    def coverage(self) -> float:
        """Share of loss tokens whose target id is in the draft vocabulary."""
        total = int(self.token_counts.sum())
        chosen = np.arange(len(self.d2t)) + self.d2t
        return float(self.token_counts[chosen].sum() / total) if total else 0.0


def count_loss_tokens(tokenized: pq.ParquetFile, vocab_size: int) -> np.ndarray:
    counts = np.zeros(vocab_size, dtype=np.int64)
    for batch in tokenized.iter_batches(columns=["input_ids", "loss_mask"], batch_size=4096):
        ids = pc.list_flatten(batch.column("input_ids")).to_numpy(zero_copy_only=False)
        mask = (
            pc.list_flatten(batch.column("loss_mask")).to_numpy(zero_copy_only=False).astype(bool)
        )
        counts += np.bincount(ids[mask], minlength=vocab_size)
    return counts


def build_vocab_map(token_counts: np.ndarray, draft_vocab_size: int) -> VocabMap:
    target_vocab_size = len(token_counts)
    if draft_vocab_size > target_vocab_size:
        raise ValueError(
            f"draft vocabulary of {draft_vocab_size} exceeds the target's {target_vocab_size} tokens"
        )
    seen = np.flatnonzero(token_counts > 0)
    ranked = seen[np.lexsort((seen, -token_counts[seen]))]  # count descending, then id ascending
    chosen = ranked[:draft_vocab_size]
    if len(chosen) < draft_vocab_size:  # fill with the lowest ids not yet chosen
        unused = np.setdiff1d(np.arange(target_vocab_size), chosen, assume_unique=True)
        chosen = np.concatenate([chosen, unused[: draft_vocab_size - len(chosen)]])
    chosen = np.sort(chosen).astype(np.int64)
    t2d = np.zeros(target_vocab_size, dtype=bool)
    t2d[chosen] = True
    return VocabMap(token_counts, chosen - np.arange(draft_vocab_size, dtype=np.int64), t2d)


def run(config: VocabConfig) -> VocabMap:
    config.check()
    header = read_header(config.tokenized)  # its kind was checked by config.check()
    vocab_size = config.target_vocab_size or header.fields["vocab_size"]
    if vocab_size < header.fields["vocab_size"]:
        raise ValueError(
            f"--target-vocab-size {vocab_size} is below the tokenized header's vocab_size {header.fields['vocab_size']}"
        )
    counts = count_loss_tokens(pq.ParquetFile(config.tokenized), vocab_size)
    vocab = build_vocab_map(counts, config.draft_vocab_size)
    lineage = {
        "tokenized_fingerprint": fingerprint_artifact(config.tokenized),
        "tokenizer_fingerprint": header.lineage["tokenizer_fingerprint"],
    }
    out_header = make_header(
        "vocab_map",
        lineage,
        draft_vocab_size=config.draft_vocab_size,
        target_vocab_size=vocab_size,
        num_loss_tokens=int(counts.sum()),
        coverage=vocab.coverage,
        distinct_loss_tokens=int((counts > 0).sum()),
    )
    write_safetensors(
        config.output,
        {"token_counts": vocab.token_counts, "d2t": vocab.d2t, "t2d": vocab.t2d},
        out_header,
    )
    return vocab
