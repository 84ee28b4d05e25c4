"""The trainer the builders of the embedded targets share: a byte-level BPE, next-token CE
on the answer (completion) tokens only, its schedule and its record in ``build_info.json``, the
unigram baseline, the Hugging Face save, the tiny corpus's held-out check and the command line
(``--check``, ``--out``, ``--steps``, ``--max-minutes``, ``--seed``, ``--threads``).

Moving code here must leave a rebuild bit-identical: the same seeded generators are drawn in
the same order (the shuffles of ``train``, the model's initialisation after ``torch.manual_seed``).
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
from pathlib import Path
from types import ModuleType

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, PreTrainedModel, PreTrainedTokenizerFast

# The tiny target's corpus, encoding and scoring are shared with the tests (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from support.tiny_corpus import Conversation, build_corpus, check_subset, write_corpus_jsonl
from support.tiny_target import (
    BUILD_INFO,
    CHECK_CONVERSATIONS,
    Encoded,
    answer_ce,
    answer_token_losses,
    collate,
    greedy_generate,
    heldout_answer_ce,
    length_batches,
)

BATCH_TOKENS = 4096  # padded tokens per optimizer step (length-bucketed batches)
PEAK_LR = 3e-3
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.1
ANSWER_LOSS = "next-token CE on assistant answer tokens (incl. <|im_end|>) only"


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


def llama_config(
    tokenizer: PreTrainedTokenizerFast, sizes: dict[str, int], max_positions: int, bos_token: str
) -> LlamaConfig:
    """A float32 Llama of ``sizes`` for ``tokenizer`` (untied head, RoPE θ 10,000)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        **sizes,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.02,
        bos_token_id=tokenizer.convert_tokens_to_ids(bos_token),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def corpus_splits() -> tuple[list[Conversation], list[Conversation], list[Conversation]]:
    """The tiny corpus, its train and its held-out conversations."""
    corpus = build_corpus()
    train_convs = [c for c in corpus if c.split == "train"]
    return corpus, train_convs, [c for c in corpus if c.split == "heldout"]


def heldout_figures(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    train_enc: Sequence[Encoded],
    heldout_enc: Sequence[Encoded],
    heldout_convs: Sequence[Conversation],
) -> tuple[float, int, float, float]:
    """A tiny-corpus target's held-out answer CE and its tokens, the unigram baseline's CE, and
    the CE on the check subset (what ``--check`` bounds)."""
    heldout_ce, heldout_tokens = answer_ce(model, heldout_enc, tokenizer.pad_token_id)
    unigram = unigram_ce(train_enc, heldout_enc, len(tokenizer))
    check_ce, _ = heldout_answer_ce(model, tokenizer, heldout_convs, CHECK_CONVERSATIONS)
    print(f"held-out answer CE {heldout_ce:.3f} nats (unigram {unigram:.3f})")
    return heldout_ce, heldout_tokens, unigram, check_ce


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


def train(
    model: PreTrainedModel,
    encoded: Sequence[Encoded],
    pad_id: int,
    args: argparse.Namespace,
    loss_text: str = ANSWER_LOSS,
    final_ce_key: str = "final_train_answer_ce",
    dtype: str | None = None,
    detailed: bool = False,
) -> dict[str, object]:
    """AdamW on the answer tokens only (prompt tokens carry no loss), fp32: ``args.steps``
    optimizer steps, or fewer if ``args.max_minutes`` runs out first.

    Returns ``build_info.json``'s "training": the run as asked and as it went (``detailed``: also
    the warmup and the loss-carrying tokens, as the tiny target records them).
    """
    steps, max_minutes = args.steps, args.max_minutes
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0}],
        lr=PEAK_LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    batches = length_batches(encoded, BATCH_TOKENS)
    rng = random.Random(args.seed)
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
    return {
        "loss": loss_text,
        **({"dtype": dtype} if dtype else {}),
        "steps": step,
        "requested_steps": steps,
        "max_minutes": max_minutes,
        "stopped_by_time": step < steps,
        "schedule_followed_time": time_bound,
        "batch_tokens": BATCH_TOKENS,
        "peak_lr": PEAK_LR,
        **({"warmup_steps": WARMUP_STEPS} if detailed else {}),
        "tokens_trained": tokens_seen,
        **({"answer_tokens_trained": answer_tokens} if detailed else {}),
        "epochs": round(tokens_seen / sum(len(e.ids) for e in encoded), 3),
        "train_seconds": round(time.monotonic() - start, 1),
        final_ce_key: round(sum(recent) / len(recent), 4),  # the mean over the last 50 steps
    }


def generation_samples(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, heldout: Sequence[Conversation]
) -> list[dict[str, str]]:
    """Greedy answers to the first two held-out prompts, printed and kept in build_info.json."""
    samples = []
    for conv in check_subset(heldout, 2):
        text = tokenizer.decode(greedy_generate(model, tokenizer, conv), skip_special_tokens=False)
        samples.append({"source": conv.source, "prompt": conv.prompt, "generation": text})
        print(f"--- {conv.prompt}\n{text}")
    return samples


def write_corpus(corpus: Sequence[Conversation], path: Path) -> int:
    """A builder's ``--corpus-only``: its conversations as OpenAI-messages JSONL, counted."""
    write_corpus_jsonl(corpus, path)
    n_heldout = sum(c.split == "heldout" for c in corpus)
    print(f"wrote {len(corpus)} conversations ({n_heldout} held-out) to {path}")
    return 0


def save_target(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """The model and its tokenizer in Hugging Face format, generating greedily to the eos."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
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


def check_heldout_ce(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, out_dir: Path, bound: float
) -> int:
    """Held-out answer CE of a target of the tiny corpus on the check subset against ``bound``:
    0 below it, 1 otherwise."""
    started = time.monotonic()
    ce, n_tokens = heldout_answer_ce(model, tokenizer, corpus_splits()[2], CHECK_CONVERSATIONS)
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


def builder_main(builder: ModuleType) -> int:
    """A builder's command line, from its module: ``--check`` runs its ``check`` on the shipped
    target (its ``corpus_only`` where it has one: ``--corpus-only OUT.jsonl``), else its ``build``
    runs after torch is seeded for the model's initialisation, and ``build_info.json`` gets the
    seed and the versions that trained it, what ``build`` returned and the build's seconds
    (printed but for its ``NOT_PRINTED``)."""
    corpus_only = getattr(builder, "corpus_only", None)
    parser = argparse.ArgumentParser(description=builder.__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="verify the shipped target")
    if corpus_only is not None:
        mode.add_argument(
            "--corpus-only", type=Path, metavar="OUT.jsonl", help="write the conversations and stop"
        )
    parser.add_argument("--out", type=Path, default=builder.TARGET_DIR, help="target directory")
    parser.add_argument("--steps", type=int, default=builder.DEFAULT_STEPS, help="optimizer steps")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=builder.DEFAULT_MAX_MINUTES,
        help="stop training after this",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.check:
        return builder.check(args)
    if corpus_only is not None and args.corpus_only:
        return corpus_only(args)
    started = time.monotonic()
    torch.manual_seed(args.seed)
    info: dict[str, object] = {
        "seed": args.seed,
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        **builder.build(args),
    }
    info["build_seconds"] = round(time.monotonic() - started, 1)
    (args.out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps({k: v for k, v in info.items() if k not in builder.NOT_PRINTED}, indent=2))
    return 0
