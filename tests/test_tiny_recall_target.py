"""The embedded recall target (recipes/tiny-recall/target): a small Llama that knows its whole
corpus by heart (tools/targets/build_tiny_recall_target.py), so that a draft measured on files it
never trained on faces text the target knows and the draft must guess.

These tests read the shipped directory and check what its card says: the draft's split shares no
file, the corpus is the build's where the stdlib is, the weights are small enough to travel to a
lent GPU, and on the held-out files the target recites: low answer CE, and greedy answers that
reproduce the corpus's own text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from support import recall_corpus, tiny_corpus, tiny_target

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "recipes" / "tiny-recall" / "target"
RECITED_TOKENS = 24  # of each held-out answer, compared token for token with the greedy answer


@pytest.fixture(scope="module")
def build_info() -> dict:
    return json.loads((TARGET / tiny_target.BUILD_INFO).read_text())


@pytest.fixture(scope="module")
def corpus() -> list:
    return recall_corpus.build_recall_corpus()


@pytest.fixture(scope="module")
def shipped() -> tuple:
    torch.set_num_threads(2)
    return tiny_target.load_target(TARGET)


def test_the_drafts_split_shares_no_file_and_holds_code_and_prose(corpus: list) -> None:
    train = [c for c in corpus if c.split == "train"]
    heldout = [c for c in corpus if c.split == "heldout"]
    assert not {c.source for c in train} & {c.source for c in heldout}
    assert len(heldout) >= 64  # the pipeline's held-out states, and its 40 prompts
    for split in (train, heldout):
        assert {c.prompt.startswith("Write") for c in split} == {True, False}  # code and prose


def test_the_corpus_is_the_builds_given_the_builds_stdlib(corpus: list, build_info: dict) -> None:
    here = tiny_corpus.stdlib_fingerprint(tiny_corpus.stdlib_root())
    assert here == build_info["stdlib_fingerprint"], "another stdlib: another corpus"
    assert tiny_corpus.corpus_fingerprint(corpus) == build_info["corpus_fingerprint"]
    assert sorted({c.source for c in corpus if c.split == "heldout"}) == build_info["heldout_sources"]  # fmt: skip


def test_the_shipped_target_is_small_and_bfloat16(build_info: dict) -> None:
    size = sum(p.stat().st_size for p in TARGET.iterdir() if p.is_file())
    assert size < 5 * 2**20  # the repository travels to a lent GPU in 64 MiB
    with safe_open(str(TARGET / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())  # a safe_open handle is not iterable
        assert {weights.get_slice(n).get_dtype() for n in names} == {"BF16"}
    assert build_info["parameters"] < 2_000_000


def test_it_recites_the_heldout_answers(shipped: tuple, corpus: list, build_info: dict) -> None:
    model, tokenizer = shipped
    heldout = [c for c in corpus if c.split == "heldout"]
    encoded = tiny_target.encode_all(tokenizer, heldout)
    ce, _ = tiny_target.answer_ce(model, encoded, tokenizer.pad_token_id)
    assert ce < build_info["check_max_heldout_ce"] < build_info["unigram_heldout_answer_ce"] - 3
    recited = 0
    for conv in tiny_corpus.check_subset(heldout, 10):
        answer = tokenizer.encode(conv.answer, add_special_tokens=False)[:RECITED_TOKENS]
        greedy = tiny_target.greedy_generate(model, tokenizer, conv, RECITED_TOKENS)
        recited += greedy[: len(answer)] == answer
    assert recited >= 9, f"{recited} of 10 held-out answers recited for {RECITED_TOKENS} tokens"
