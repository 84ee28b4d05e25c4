"""Build the embedded target that knows more than its draft: a small Llama that has learned its
whole corpus, code and prose, by heart.

The other tiny targets are at their drafts' ceiling: their greedy answers are generic code a
one-layer draft predicts 9 times in 10. A large target is hard to draft for because it knows
what its draft never saw. This target reproduces that at CPU size: it is trained for tens of
epochs on every conversation of a small corpus (standard-library functions as code, module
docstrings as prose: ``tests/support/recall_corpus.py``), so its greedy answers are the specific
text it memorised. The draft is trained on the conversations of the "train" files only and
measured on the others ("held-out", by file): there the target recites what the draft must guess.

    user:      Write a Python function `name(args)` that does this: <docstring's first line>.
    assistant: <the function's source code>
    user:      What does the Python module `name` provide?
    assistant: <the module's docstring>

It ships under ``recipes/tiny-recall/target/`` (weights in bfloat16: the repository travels to a
lent GPU in 64 MiB) with ``build_info.json`` and a card.

    uv run tools/targets/build_tiny_recall_target.py                  # full build, ~25 min on 2 cores
    uv run tools/targets/build_tiny_recall_target.py --check          # verify the shipped target
    uv run tools/targets/build_tiny_recall_target.py --corpus-only OUT.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under python -P
import build_tiny_target as tiny
import target_training as training
import torch
from transformers import LlamaForCausalLM

from support.recall_corpus import build_recall_corpus
from support.tiny_corpus import (
    corpus_fingerprint,
    stdlib_fingerprint,
    stdlib_root,
)
from support.tiny_target import PAD_TOKEN, answer_ce, encode_all, load_target

TARGET_DIR = Path(__file__).resolve().parents[2] / "recipes" / "tiny-recall" / "target"
VOCAB_SIZE = 2048
MODEL_SIZES = {  # head size 64, as every vLLM CPU attention kernel runs
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}
CHECK_MAX_HELDOUT_CE = 0.1  # nats: it recites the held-out answers (0.0026 at the build)
DEFAULT_STEPS = 2200
DEFAULT_MAX_MINUTES = 22.0
NOT_PRINTED = ("heldout_sources", "samples")


def round_to_bfloat16(model: torch.nn.Module) -> None:
    """The weights as they ship: every figure of the build is measured on them."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def build(args: argparse.Namespace) -> dict[str, object]:
    corpus = build_recall_corpus()
    train_convs = [c for c in corpus if c.split == "train"]
    heldout_convs = [c for c in corpus if c.split == "heldout"]
    texts = [t for c in corpus for t in (f"user\n{c.prompt}", f"assistant\n{c.answer}")]
    tokenizer = tiny.train_tokenizer(texts, VOCAB_SIZE)
    encoded = encode_all(tokenizer, corpus)
    train_enc, heldout_enc = (
        encode_all(tokenizer, train_convs),
        encode_all(tokenizer, heldout_convs),
    )
    print(f"corpus: {len(train_convs)} train / {len(heldout_convs)} held-out conversations, "
          f"{sum(len(e.ids) for e in encoded)} tokens")  # fmt: skip
    model = LlamaForCausalLM(training.llama_config(tokenizer, MODEL_SIZES, 2048, PAD_TOKEN))
    record = training.train(model, encoded, tokenizer.pad_token_id, args, detailed=True)
    round_to_bfloat16(model)
    heldout_ce, heldout_tokens = answer_ce(model, heldout_enc, tokenizer.pad_token_id)
    train_ce, _ = answer_ce(model, train_enc, tokenizer.pad_token_id)
    unigram = training.unigram_ce(train_enc, heldout_enc, len(tokenizer))
    print(
        f"answer CE: held-out {heldout_ce:.3f}, train {train_ce:.3f} nats (unigram {unigram:.3f})"
    )
    samples = training.generation_samples(model, tokenizer, heldout_convs)
    training.save_target(model.to(torch.bfloat16), tokenizer, args.out)
    return {
        "stdlib_fingerprint": stdlib_fingerprint(stdlib_root()),
        "corpus_fingerprint": corpus_fingerprint(corpus),
        # Read by eagle3-eval --heldout-sources: prompts only from files the draft never saw.
        "heldout_sources": sorted({c.source for c in heldout_convs}),
        "corpus": {
            "functions": sum(c.prompt.startswith("Write") for c in corpus),
            "train_conversations": len(train_convs),
            "heldout_conversations": len(heldout_convs),
            "tokens": sum(len(e.ids) for e in encoded),
            "heldout_answer_tokens": heldout_tokens,
        },
        "vocab_size": len(tokenizer),
        "model_sizes": MODEL_SIZES,
        "parameters": model.num_parameters(),
        "training": record,
        "heldout_answer_ce": round(heldout_ce, 4),
        "train_answer_ce": round(train_ce, 4),
        "unigram_heldout_answer_ce": round(unigram, 4),
        "check_max_heldout_ce": CHECK_MAX_HELDOUT_CE,
        "samples": samples,
    }


def check(args: argparse.Namespace) -> int:
    """The shipped target recites its held-out answers: their CE below CHECK_MAX_HELDOUT_CE."""
    model, tokenizer = load_target(args.out)
    heldout = [c for c in build_recall_corpus() if c.split == "heldout"]
    ce, n = answer_ce(model, encode_all(tokenizer, heldout), tokenizer.pad_token_id)
    recorded = json.loads((args.out / "build_info.json").read_text())["heldout_answer_ce"]
    print(f"held-out answer CE {ce:.4f} nats on {n} tokens; recorded {recorded}; "
          f"bound {CHECK_MAX_HELDOUT_CE}")  # fmt: skip
    if ce < CHECK_MAX_HELDOUT_CE:
        print("OK")
        return 0
    print("FAIL: the target does not know its held-out answers", file=sys.stderr)
    return 1


def corpus_only(args: argparse.Namespace) -> int:
    return training.write_corpus(build_recall_corpus(), args.corpus_only)


if __name__ == "__main__":
    sys.exit(training.builder_main(sys.modules[__name__]))
