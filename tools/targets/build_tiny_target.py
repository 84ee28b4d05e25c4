"""Build the project's embedded default target: a small Llama really trained on Python code.

The target is trained here, on CPU, from text every Python install has offline: the functions
(with docstrings) of the Python standard library, turned into chat conversations

    user:      Write a Python function `name(args)` that does this: <docstring's first line>.
    assistant: <the function's source code>

It ships under ``recipes/tiny/target/`` in Hugging Face format (Llama weights, a byte-level BPE
tokenizer trained on the same corpus, a ChatML chat template) with ``build_info.json``.

    uv run tools/targets/build_tiny_target.py                        # full build, ~11 min on 2 cores
    uv run tools/targets/build_tiny_target.py --check                # verify the shipped target, < 30 s
    uv run tools/targets/build_tiny_target.py --corpus-only OUT.jsonl  # only write the conversations

The corpus depends on the standard library of the running interpreter: an exact rebuild
needs the same standard-library files. ``build_info.json`` records their fingerprint
(``stdlib_fingerprint``) and the corpus's (``corpus_fingerprint``), so a test can tell "another
stdlib" from "the corpus code changed" by content, whatever the Python version string says.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

# The trainer the builders share, beside this file; it puts tests/ on the path (tests/support
# holds the corpus and the target's scoring, shared with the tests).
sys.path.insert(0, str(Path(__file__).resolve().parent))  # also under python -P
import target_training as training
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from support.tiny_corpus import (
    MAX_FUNCTION_CHARS,
    build_corpus,
    check_subset,
    corpus_fingerprint,
    stdlib_files,
    stdlib_fingerprint,
    stdlib_root,
)
from support.tiny_target import (
    CHECK_CONVERSATIONS,
    CHECK_MAX_CE,
    IM_END,
    IM_START,
    MAX_SEQ_LEN,
    PAD_TOKEN,
    TARGET_DIR,  # noqa: F401 (training.builder_main reads it)
    encode_all,
    load_target,
)

VOCAB_SIZE = 4096  # including the special tokens
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]  # ids 0, 1, 2

# ChatML. Newlines are written as explicit strings: the template renders with trim_blocks.
# Assistant content (and its <|im_end|>) sits in {% generation %} so that
# return_assistant_tokens_mask works; nothing in this project requires those tags.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message['content'] + '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

DEFAULT_STEPS = 300
DEFAULT_MAX_MINUTES = 25.0
NOT_PRINTED = ("heldout_sources", "samples")  # of build_info.json, when the build ends
MODEL_SIZES = {
    "hidden_size": 256,
    "intermediate_size": 576,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the ChatML special tokens and chat template."""
    tok = training.train_bpe(texts, vocab_size, SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def build(args: argparse.Namespace) -> dict[str, object]:
    corpus, train_convs, heldout_convs = training.corpus_splits()
    print(f"corpus: {len(train_convs)} train / {len(heldout_convs)} held-out conversations")

    # the text between the special tokens of the rendered conversations
    texts = [t for c in train_convs for t in (f"user\n{c.prompt}", f"assistant\n{c.answer}")]
    tokenizer = train_tokenizer(texts)
    train_enc = encode_all(tokenizer, train_convs)
    heldout_enc = encode_all(tokenizer, heldout_convs)
    pad_id = tokenizer.pad_token_id
    print(
        f"tokenizer: {len(tokenizer)} tokens; encoded {len(train_enc)} train "
        f"({sum(len(e.ids) for e in train_enc)} tokens) / {len(heldout_enc)} held-out"
    )

    model = LlamaForCausalLM(training.llama_config(tokenizer, MODEL_SIZES, 2048, PAD_TOKEN))
    n_params = model.num_parameters()
    print(f"model: {n_params} parameters")
    record = training.train(model, train_enc, pad_id, args, detailed=True)

    heldout_ce, heldout_tokens, unigram, check_ce = training.heldout_figures(
        model, tokenizer, train_enc, heldout_enc, heldout_convs
    )
    check_unigram = training.unigram_ce(
        train_enc,
        encode_all(tokenizer, check_subset(heldout_convs, CHECK_CONVERSATIONS)),
        len(tokenizer),
    )
    samples = training.generation_samples(model, tokenizer, heldout_convs)
    training.save_target(model, tokenizer, args.out)
    return {
        "stdlib_files": len(stdlib_files(stdlib_root())),
        "stdlib_fingerprint": stdlib_fingerprint(stdlib_root()),
        "corpus_fingerprint": corpus_fingerprint(corpus),
        "heldout_sources": sorted({c.source for c in heldout_convs}),
        "corpus": {
            "train_conversations": len(train_convs),
            "heldout_conversations": len(heldout_convs),
            "train_conversations_encoded": len(train_enc),
            "heldout_conversations_encoded": len(heldout_enc),
            "train_tokens": sum(len(e.ids) for e in train_enc),
            "train_answer_tokens": sum(sum(e.answer_mask) for e in train_enc),
            "heldout_tokens": sum(len(e.ids) for e in heldout_enc),
            "heldout_answer_tokens": heldout_tokens,
            "max_seq_len": MAX_SEQ_LEN,
            "max_function_chars": MAX_FUNCTION_CHARS,
        },
        "vocab_size": len(tokenizer),
        "parameters": n_params,
        "training": record,
        "heldout_answer_ce": round(heldout_ce, 4),
        "unigram_heldout_answer_ce": round(unigram, 4),
        "check_subset_conversations": CHECK_CONVERSATIONS,
        "check_subset_answer_ce": round(check_ce, 4),
        "check_subset_unigram_ce": round(check_unigram, 4),
        "check_max_ce": CHECK_MAX_CE,
        "samples": samples,
    }


def check(args: argparse.Namespace) -> int:
    model, tokenizer = load_target(args.out)
    return training.check_heldout_ce(model, tokenizer, args.out, CHECK_MAX_CE)


def corpus_only(args: argparse.Namespace) -> int:
    return training.write_corpus(build_corpus(), args.corpus_only)


if __name__ == "__main__":
    sys.exit(training.builder_main(sys.modules[__name__]))
