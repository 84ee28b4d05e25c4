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
import json
import math
import platform
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

# The corpus and the target's scoring are shared with the tests (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.tiny_corpus import (
    MAX_FUNCTION_CHARS,
    Conversation,
    build_corpus,
    check_subset,
    corpus_fingerprint,
    stdlib_files,
    stdlib_fingerprint,
    stdlib_root,
    write_corpus_jsonl,
)
from support.tiny_target import (
    BUILD_INFO,
    CHECK_CONVERSATIONS,
    CHECK_MAX_CE,
    IM_END,
    IM_START,
    MAX_SEQ_LEN,
    PAD_TOKEN,
    TARGET_DIR,
    Encoded,
    answer_ce,
    answer_token_losses,
    collate,
    encode_all,
    greedy_generate,
    heldout_answer_ce,
    length_batches,
    load_target,
)

# --- Tokenizer and chat template ---------------------------------------------------------------

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

# --- Model and training ------------------------------------------------------------------------

BATCH_TOKENS = 4096  # padded tokens per optimizer step (length-bucketed batches)
DEFAULT_STEPS = 300
DEFAULT_MAX_MINUTES = 25.0
PEAK_LR = 3e-3
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.1

# --- Tokenizer ---------------------------------------------------------------------------------


def train_bpe(texts: Sequence[str], vocab_size: int, special_tokens: Sequence[str]) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens, ``special_tokens`` first (the embedded targets')."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the ChatML special tokens and chat template."""
    tok = train_bpe(texts, vocab_size, SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def tokenizer_texts(convs: Sequence[Conversation]) -> list[str]:
    """The text between special tokens in rendered conversations, to train the tokenizer on."""
    return [text for c in convs for text in (f"user\n{c.prompt}", f"assistant\n{c.answer}")]


# --- Model -------------------------------------------------------------------------------------


def model_config(tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=576,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        dtype="float32",
    )


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- Batches, loss, training -------------------------------------------------------------------


def unigram_ce(train: Sequence[Encoded], heldout: Sequence[Encoded], vocab_size: int) -> float:
    """CE of an add-one-smoothed unigram model of training answer tokens on held-out answers.

    Like answer_ce, it scores the answer tokens that have a predecessor (all of them).
    """
    counts = torch.ones(vocab_size, dtype=torch.float64)
    for e in train:
        counts += torch.bincount(_answer_ids(e), minlength=vocab_size).double()
    log_probs = counts.log() - counts.sum().log()
    targets = torch.cat([_answer_ids(e) for e in heldout])
    return -log_probs[targets].mean().item()


def _answer_ids(e: Encoded) -> torch.Tensor:
    ids = torch.tensor(e.ids)
    return ids[torch.tensor(e.answer_mask, dtype=torch.bool)]


def lr_at(step: int, total_steps: int, time_fraction: float = 0.0) -> float:
    """Linear warmup over WARMUP_STEPS, then cosine decay to 10 % of the peak.

    The decay follows whichever budget is being spent faster, steps or time, so that a run cut
    short by --max-minutes on a slow or busy machine still ends annealed.
    """
    if step < WARMUP_STEPS:
        return PEAK_LR * (step + 1) / WARMUP_STEPS
    progress = max((step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS), time_fraction)
    return PEAK_LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@dataclass
class TrainStats:
    steps: int
    tokens_seen: int  # non-padding tokens through the model
    answer_tokens_trained: int  # tokens that carried loss
    epochs: float
    final_train_loss: float  # mean answer CE over the last 50 steps
    seconds: float
    stopped_by_time: bool
    time_bound: bool


def train(
    model: LlamaForCausalLM,
    encoded: Sequence[Encoded],
    pad_id: int,
    steps: int,
    max_minutes: float,
    seed: int,
) -> TrainStats:
    """AdamW on the answer tokens only (prompt tokens carry no loss), fp32.

    Runs `steps` optimizer steps, or fewer if `max_minutes` runs out first.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    batches = length_batches(encoded, BATCH_TOKENS)
    rng = random.Random(seed)
    model.train()
    start = time.monotonic()
    recent: list[float] = []
    tokens_seen = answer_tokens = 0
    step = 0
    time_fraction = 0.0
    time_bound = False  # the schedule followed the clock at some step: not bit-reproducible
    order: list[int] = []
    while step < steps and time_fraction < 1.0:
        if not order:
            order = list(range(len(batches)))
            rng.shuffle(order)
        ids, attn, answer = collate(encoded, batches[order.pop()], pad_id)
        lr = lr_at(step, steps, time_fraction)
        time_bound = time_bound or lr != lr_at(step, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum, n = answer_token_losses(model, ids, attn, answer)
        loss = loss_sum / n
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        tokens_seen += int(attn.sum())
        answer_tokens += int(n)
        recent = [*recent[-49:], loss.item()]
        elapsed = time.monotonic() - start
        time_fraction = elapsed / (max_minutes * 60)
        if step % 25 == 0 or step == steps or time_fraction >= 1.0:
            print(
                f"step {step}/{steps}  loss {sum(recent) / len(recent):.3f}  lr {lr:.2e}  "
                f"tokens {tokens_seen}  {elapsed:.0f}s",
                flush=True,
            )
    epoch_tokens = sum(len(e.ids) for e in encoded)
    return TrainStats(
        steps=step,
        tokens_seen=tokens_seen,
        answer_tokens_trained=answer_tokens,
        epochs=tokens_seen / epoch_tokens,
        final_train_loss=sum(recent) / len(recent),
        seconds=time.monotonic() - start,
        stopped_by_time=step < steps,
        time_bound=time_bound,
    )


# --- Commands ----------------------------------------------------------------------------------


def build(args: argparse.Namespace) -> int:
    started = time.monotonic()
    torch.manual_seed(args.seed)
    out_dir: Path = args.out

    corpus = build_corpus()
    train_convs = [c for c in corpus if c.split == "train"]
    heldout_convs = [c for c in corpus if c.split == "heldout"]
    print(f"corpus: {len(train_convs)} train / {len(heldout_convs)} held-out conversations")

    tokenizer = train_tokenizer(tokenizer_texts(train_convs))
    train_enc = encode_all(tokenizer, train_convs)
    heldout_enc = encode_all(tokenizer, heldout_convs)
    pad_id = tokenizer.pad_token_id
    print(
        f"tokenizer: {len(tokenizer)} tokens; encoded {len(train_enc)} train "
        f"({sum(len(e.ids) for e in train_enc)} tokens) / {len(heldout_enc)} held-out"
    )

    model = LlamaForCausalLM(model_config(tokenizer))
    n_params = count_parameters(model)
    print(f"model: {n_params} parameters")
    stats = train(model, train_enc, pad_id, args.steps, args.max_minutes, args.seed)

    heldout_ce, heldout_tokens = answer_ce(model, heldout_enc, pad_id)
    unigram = unigram_ce(train_enc, heldout_enc, len(tokenizer))
    check_ce, _ = heldout_answer_ce(model, tokenizer, heldout_convs, CHECK_CONVERSATIONS)
    check_unigram = unigram_ce(
        train_enc,
        encode_all(tokenizer, check_subset(heldout_convs, CHECK_CONVERSATIONS)),
        len(tokenizer),
    )
    print(f"held-out answer CE {heldout_ce:.3f} nats (unigram {unigram:.3f})")

    samples = []
    for conv in check_subset(heldout_convs, 2):
        text = tokenizer.decode(greedy_generate(model, tokenizer, conv), skip_special_tokens=False)
        samples.append({"source": conv.source, "prompt": conv.prompt, "generation": text})
        print(f"--- {conv.prompt}\n{text}")

    save_target(model, tokenizer, out_dir)
    info = {
        "seed": args.seed,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
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
        "training": {
            "loss": "next-token CE on assistant answer tokens (incl. <|im_end|>) only",
            "steps": stats.steps,
            "requested_steps": args.steps,
            "max_minutes": args.max_minutes,
            "stopped_by_time": stats.stopped_by_time,
            "schedule_followed_time": stats.time_bound,
            "batch_tokens": BATCH_TOKENS,
            "peak_lr": PEAK_LR,
            "warmup_steps": WARMUP_STEPS,
            "tokens_trained": stats.tokens_seen,
            "answer_tokens_trained": stats.answer_tokens_trained,
            "epochs": round(stats.epochs, 3),
            "train_seconds": round(stats.seconds, 1),
            "final_train_answer_ce": round(stats.final_train_loss, 4),
        },
        "heldout_answer_ce": round(heldout_ce, 4),
        "unigram_heldout_answer_ce": round(unigram, 4),
        "check_subset_conversations": CHECK_CONVERSATIONS,
        "check_subset_answer_ce": round(check_ce, 4),
        "check_subset_unigram_ce": round(check_unigram, 4),
        "check_max_ce": CHECK_MAX_CE,
        "samples": samples,
        "build_seconds": round(time.monotonic() - started, 1),
    }
    (out_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    print(
        json.dumps(
            {k: v for k, v in info.items() if k not in ("heldout_sources", "samples")}, indent=2
        )
    )
    return 0


def save_target(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    # Template inside tokenizer_config.json, and the class name transformers 4.x knows too, so
    # that older loaders (vLLM's pinned transformers, speculators) read the same tokenizer.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    # tokenizer.json without indentation: the same tokenizer in 40 % of the bytes, so that the
    # repository still fits the 64 MiB a GPU check carries.
    tokenizer_file = out_dir / "tokenizer.json"
    compact = json.dumps(
        json.loads(tokenizer_file.read_text()), ensure_ascii=False, separators=(",", ":")
    )
    tokenizer_file.write_text(compact, encoding="utf-8")
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")


def check(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model, tokenizer = load_target(args.out)
    return check_verdict(model, tokenizer, args.out, CHECK_MAX_CE)


def check_verdict(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: Path, bound: float
) -> int:
    """Held-out answer CE on the check subset against ``bound``: 0 below it, 1 otherwise."""
    started = time.monotonic()
    heldout = [c for c in build_corpus() if c.split == "heldout"]
    ce, n_tokens = heldout_answer_ce(model, tokenizer, heldout, CHECK_CONVERSATIONS)
    info = json.loads((out_dir / BUILD_INFO).read_text())
    print(
        f"held-out answer CE on {CHECK_CONVERSATIONS} conversations ({n_tokens} tokens): "
        f"{ce:.4f} nats; recorded at build {info['check_subset_answer_ce']:.4f}; "
        f"bound {bound} ({time.monotonic() - started:.1f}s)"
    )
    if ce < bound:
        print("OK")
        return 0
    print("FAIL: held-out answer CE is not below the bound", file=sys.stderr)
    return 1


def corpus_only(args: argparse.Namespace) -> int:
    corpus = build_corpus()
    write_corpus_jsonl(corpus, args.corpus_only)
    n_heldout = sum(c.split == "heldout" for c in corpus)
    print(f"wrote {len(corpus)} conversations ({n_heldout} held-out) to {args.corpus_only}")
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="verify the shipped target")
    mode.add_argument(
        "--corpus-only", type=Path, metavar="OUT.jsonl", help="write the conversations and stop"
    )
    parser.add_argument("--out", type=Path, default=TARGET_DIR, help="target directory")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument(
        "--max-minutes", type=float, default=DEFAULT_MAX_MINUTES, help="stop training after this"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.check:
        return check(args)
    if args.corpus_only:
        return corpus_only(args)
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
