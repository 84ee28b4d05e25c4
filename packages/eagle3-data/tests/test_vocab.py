"""The draft vocabulary: identical to speculators' mapping on the same counts, in vLLM's convention."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from eagle3_data.config import TokenizeConfig, VocabConfig
from eagle3_data.tokenization import run as tokenize
from eagle3_data.vocab import build_vocab_map, run
from eagle3_schemas import fingerprint_artifact, read_header, validate


@st.composite
def counts_and_size(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    vocab = draw(st.integers(1, 300))
    # many zeros and many ties: the cases where tie-breaking and filling decide the result
    counts = np.array(
        draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, 3, 5, 100]), min_size=vocab, max_size=vocab)),
        dtype=np.int64,
    )
    return counts, draw(st.integers(1, vocab))


@settings(max_examples=200, deadline=None)
@given(case=counts_and_size())
def test_identical_to_speculators_on_the_same_counts(case: tuple[np.ndarray, int]) -> None:
    counts, draft_size = case
    ours = build_vocab_map(counts, draft_size)
    freq = {
        int(i): int(c) for i, c in enumerate(counts) if c > 0
    }  # speculators keeps only seen tokens
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_size, len(counts))
    np.testing.assert_array_equal(ours.d2t, d2t.numpy())
    np.testing.assert_array_equal(ours.t2d, t2d.numpy())
    assert ours.d2t.dtype == np.int64 and d2t.dtype == torch.int64


def test_offsets_sorted_and_coverage() -> None:
    counts = np.array([0, 9, 0, 4, 4, 1, 0, 7], dtype=np.int64)
    vocab = build_vocab_map(counts, 3)
    targets = np.arange(3) + vocab.d2t
    assert targets.tolist() == [
        1,
        3,
        7,
    ]  # the three most frequent; 3 beats 4 on the tie by lower id
    assert vocab.t2d.tolist() == [False, True, False, True, False, False, False, True]
    assert vocab.coverage == (9 + 4 + 7) / 25


def test_fewer_distinct_tokens_than_the_draft_vocabulary() -> None:
    vocab = build_vocab_map(np.array([0, 0, 5, 0, 0, 2], dtype=np.int64), 4)
    assert (np.arange(4) + vocab.d2t).tolist() == [
        0,
        1,
        2,
        5,
    ]  # seen tokens, then the lowest free ids
    assert vocab.coverage == 1.0


def test_end_to_end_on_qwen3(
    qwen3_tokenizer_dir: Path, tmp_path: Path, write_conversations
) -> None:
    source = write_conversations(
        tmp_path / "c.parquet",
        [
            [
                {"role": "user", "content": f"Show {i}."},
                {"role": "assistant", "content": f"print({i} * {i})"},
            ]
            for i in range(30)
        ],
    )
    tokenized = tmp_path / "tok.parquet"
    tokenize(
        TokenizeConfig(source, qwen3_tokenizer_dir, tokenized, tmp_path / "r.jsonl", workers=1)
    )
    out = tmp_path / "vocab.safetensors"
    vocab = run(VocabConfig(tokenized, out, draft_vocab_size=64))
    assert validate(out) == []
    header = read_header(out)
    assert header.lineage["tokenized_fingerprint"] == fingerprint_artifact(tokenized)
    assert (
        header.lineage["tokenizer_fingerprint"]
        == read_header(tokenized).lineage["tokenizer_fingerprint"]
    )
    table = pq.read_table(tokenized).to_pylist()
    loss_tokens = [
        t for row in table for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m
    ]
    assert header.fields["num_loss_tokens"] == len(loss_tokens)
    assert int(vocab.token_counts.sum()) == len(loss_tokens) and len(vocab.t2d) == 151669
    assert vocab.coverage == 1.0  # fewer than 64 distinct answer tokens here
