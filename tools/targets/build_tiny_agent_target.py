"""Build the project's third embedded target: a small model that thinks and calls tools, in Kimi-K2.5's chat format.

Kimi-K2.5 users serve three kinds of traffic: instant answers, thinking answers (reasoning inside
``<think>``) and agent loops (tool calls, then answers after the results). The other two
embedded targets answer in one plain mode, so nothing measured a draft on the other two. This
target is trained on ``tests/support/agent_corpus.py`` (a seeded program: a shop, three tools
whose results it computes, the three kinds), rendered with Kimi-K2.5's chat template (the Kimi
stand-in's ``chat_template.jinja``), so vLLM's ``kimi_k2`` reasoning and tool parsers
read what it generates.

- The tokenizer: byte-level BPE (2,048 tokens) trained on the rendered corpus, plus Kimi's
  special tokens (``<|im_user|>``, ``<|im_assistant|>``, ``<|im_system|>``, ``<|im_middle|>``,
  ``<|im_end|>``, ``<think>``, ``</think>`` and the tool-call section markers) as single tokens,
  a ``PreTrainedTokenizerFast`` (no remote code).
- The model: a Llama (hidden 128, 6 layers, head size 64), float32, ~1.7M parameters, ~7 MB.
  Not Kimi's MLA + MoE layout: vLLM's CPU backend runs MLA only at the real ``kv_lora_rank``
  512 + 64, which makes an MLA model several times larger, and the repository travels to a lent
  GPU in 64 MiB with the two other targets (46 MB) and the GPU check's wheels (7.6 MB) already in.
- Training: next-token CE on what the model generates at each generation event (reasoning,
  ``</think>``, the answer, the tool-call section, ``<|im_end|>``), each event's prompt rendered
  as vLLM renders it; consecutive events of one question share one sequence (their prompts
  extend each other exactly), a follow-up question starts a new one (Kimi drops earlier
  reasoning from the history).

It ships under ``recipes/tiny-agent/target/`` with ``build_info.json`` and a model card
(``README.md``) saying what it learned: held-out CE per kind, and the share of held-out tool
calls whose arguments parse and name a declared tool.

    uv run tools/targets/build_tiny_agent_target.py              # full build, ~15 min on 2 cores
    uv run tools/targets/build_tiny_agent_target.py --check      # verify the shipped target
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The trainer the builders share, beside this file; it puts tests/ on the path (tests/support
# holds the corpus and the target's shared code, shared with the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under python -P
import target_training as training
from tokenizers import Tokenizer, models
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from support import agent_corpus
from support.agent_target import (
    BOS,
    BUILD_INFO,
    CHECK_EVENTS,
    CHECK_MARGIN_NATS,
    IM_END,
    MAX_SEQ_LEN,
    PAD,
    SPECIAL_TOKENS,
    TARGET_DIR,  # noqa: F401 (training.builder_main reads it)
    ce_per_kind,
    chat_template,
    check_failures,
    encode_row,
    events,
    heldout_events,
    load_target,
    tool_call_quality,
)

SPLIT_ON_SPECIALS = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
VOCAB_SIZE = 2048

MODEL_SIZES = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 6,  # as the tiny Llama target: the same aux layers are captured
    "num_attention_heads": 2,
    "num_key_value_heads": 1,  # head size 64: a size every vLLM CPU attention kernel runs
}
DEFAULT_STEPS = 600
DEFAULT_MAX_MINUTES = 20.0
NOT_PRINTED = ("heldout_sources",)  # of build_info.json, when the build ends


def train_tokenizer(rows: Sequence[dict[str, Any]]) -> PreTrainedTokenizerFast:
    """Byte-level BPE on the rendered corpus (split at the special tokens) plus Kimi's specials."""
    template = chat_template()
    renderer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), chat_template=template
    )
    texts = [
        piece
        for row in rows
        for prompt, completion in events(renderer, row)
        for piece in SPLIT_ON_SPECIALS.split(prompt + completion)
        if piece
    ]
    return PreTrainedTokenizerFast(
        tokenizer_object=training.train_bpe(texts, VOCAB_SIZE, SPECIAL_TOKENS),
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        chat_template=template,
        model_max_length=MAX_SEQ_LEN * 2,
        clean_up_tokenization_spaces=False,
    )


def unigram_per_kind(
    tokenizer: PreTrainedTokenizerFast, rows: Sequence[dict[str, Any]]
) -> dict[str, float]:
    """The baseline: an add-one unigram of the training completions, on each kind's subset."""
    train = [e for r in rows if r["split"] == "train" for e in encode_row(tokenizer, r)]
    out = {}
    for kind in agent_corpus.KINDS:
        encoded = [e for r in heldout_events(rows, kind, CHECK_EVENTS) for e in encode_row(tokenizer, r)]  # fmt: skip
        out[kind] = round(training.unigram_ce(train, encoded, len(tokenizer)), 4)
    return out


def build(args: argparse.Namespace) -> dict[str, object]:
    rows = agent_corpus.build_agent_corpus(seed=args.seed)
    train_rows = [r for r in rows if r["split"] == "train"]
    tokenizer = train_tokenizer(train_rows)
    encoded = [e for r in train_rows for e in encode_row(tokenizer, r)]
    kept = [e for e in encoded if len(e.ids) <= MAX_SEQ_LEN]
    print(f"corpus: {len(train_rows)} train rows -> {len(kept)} sequences "
          f"({sum(len(e.ids) for e in kept)} tokens; {len(encoded) - len(kept)} too long)")  # fmt: skip
    model = LlamaForCausalLM(training.llama_config(tokenizer, MODEL_SIZES, MAX_SEQ_LEN * 2, BOS))
    n_params = model.num_parameters()
    print(f"tokenizer: {len(tokenizer)} tokens; model: {n_params} parameters")
    loss = "next-token CE on each generation event's completion (reasoning, </think>, answer, "
    loss += "tool-call section, <|im_end|>) only"
    record = training.train(
        model, kept, tokenizer.pad_token_id, args, loss, "final_train_completion_ce"
    )
    training.save_target(model, tokenizer, args.out)
    shipped, tokenizer = load_target(args.out)
    ce = ce_per_kind(shipped, tokenizer, rows)
    calls = tool_call_quality(shipped, tokenizer, rows)
    print(f"held-out CE per kind {ce}; tool calls {calls}")
    return {
        "corpus": "tests/support/agent_corpus.py",
        "corpus_fingerprint": agent_corpus.corpus_fingerprint(rows),
        # Read by eagle3-eval --heldout-sources: prompts only from rows no training saw.
        "heldout_sources": sorted(r["source"] for r in rows if r["split"] == "heldout"),
        "rows": {k: sum(r["kind"] == k for r in rows) for k in agent_corpus.KINDS},
        "train_sequences": len(kept),
        "train_tokens": sum(len(e.ids) for e in kept),
        "sequences_too_long": len(encoded) - len(kept),
        "vocab_size": len(tokenizer),
        "model_sizes": MODEL_SIZES,
        "parameters": n_params,
        "training": record,
        "heldout_ce_per_kind": ce,
        "unigram_ce_per_kind": unigram_per_kind(tokenizer, rows),
        "check_events_per_kind": CHECK_EVENTS,
        "check_margin_nats": CHECK_MARGIN_NATS,
        "tool_calls": calls,
    }


def check(args: argparse.Namespace) -> int:
    """Each kind's held-out CE CHECK_MARGIN_NATS below its unigram baseline: 0, else 1."""
    model, tokenizer = load_target(args.out)
    seed = json.loads((args.out / BUILD_INFO).read_text())["seed"]
    rows = agent_corpus.build_agent_corpus(seed=seed)
    ce, unigram = ce_per_kind(model, tokenizer, rows), unigram_per_kind(tokenizer, rows)
    print(f"held-out CE per kind {ce}; unigram {unigram}; margin {CHECK_MARGIN_NATS} nats")
    failures = check_failures(ce, unigram)
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    if not failures:
        print("OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(training.builder_main(sys.modules[__name__]))
