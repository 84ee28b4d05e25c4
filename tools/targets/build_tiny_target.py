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
import ast
import hashlib
import json
import math
import platform
import random
import sys
import sysconfig
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGET_DIR = REPO_ROOT / "recipes" / "tiny" / "target"
BUILD_INFO = "build_info.json"

# --- Corpus -----------------------------------------------------------------------------------

HELDOUT_PERCENT = 5  # share of standard-library *files* held out (split by path hash)
MAX_FUNCTION_CHARS = 1500  # longer functions are left out, so samples stay short
SKIPPED_DIRS = frozenset(
    # Test suites are absent from many Python distributions; third-party code is not stdlib.
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)

# --- Tokenizer and chat template ---------------------------------------------------------------

VOCAB_SIZE = 4096  # including the special tokens
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # ends every turn; the eos token of generation
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

MAX_SEQ_LEN = 512  # conversations with more tokens are left out of training and evaluation
BATCH_TOKENS = 4096  # padded tokens per optimizer step (length-bucketed batches)
DEFAULT_STEPS = 300
DEFAULT_MAX_MINUTES = 25.0
PEAK_LR = 3e-3
WARMUP_STEPS = 30
WEIGHT_DECAY = 0.1

# --- Check -------------------------------------------------------------------------------------

CHECK_CONVERSATIONS = 200  # held-out conversations scored by --check
# Held-out answer CE (nats/token) the shipped target must stay below: the unigram baseline on
# the same tokens (6.49) minus 1.5 nats. The build measured 4.72 ("check_subset_answer_ce" in
# recipes/tiny/target/build_info.json).
CHECK_MAX_CE = 5.0


@dataclass(frozen=True)
class Conversation:
    """One standard-library function as a user request and the assistant's answer."""

    source: str  # path relative to the stdlib root, POSIX separators
    name: str  # qualified name inside the file, e.g. "Class.method"
    lineno: int
    split: str  # "train" or "heldout"
    prompt: str
    answer: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": self.prompt},
            {"role": "assistant", "content": self.answer},
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "messages": self.messages,
            "source": self.source,
            "split": self.split,
            "name": self.name,
            "lineno": self.lineno,
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative POSIX paths of the standard library's Python files, sorted."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not SKIPPED_DIRS.intersection(rel.parts):
            files.append(rel.as_posix())
    return sorted(files)


def split_of(relpath: str) -> str:
    """Split a whole file into train or held-out by the hash of its path (stable everywhere)."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"{node.name}({args})"


def _request(node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str | None, doc: str) -> str:
    summary = doc.strip().splitlines()[0].strip().rstrip(".")
    summary = summary[:1].lower() + summary[1:]
    kind = "async function" if isinstance(node, ast.AsyncFunctionDef) else "function"
    if owner is None:
        return f"Write a Python {kind} `{_signature(node)}` that does this: {summary}."
    return f"Write the method `{_signature(node)}` of class `{owner}` that does this: {summary}."


def _functions(
    tree: ast.AST, prefix: str = "", owner: str | None = None
) -> Iterator[tuple[str, str | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, enclosing class, node) of every function, methods included, in order."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, owner, node
            yield from _functions(node, f"{prefix}{node.name}.", None)
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.", node.name)
        else:
            yield from _functions(node, prefix, owner)


def conversations_of_file(root: Path, relpath: str) -> list[Conversation]:
    source = (root / relpath).read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    split = split_of(relpath)
    out = []
    for qualname, owner, node in _functions(tree):
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        code = textwrap.dedent("".join(lines[first - 1 : node.end_lineno])).rstrip() + "\n"
        if len(code) > MAX_FUNCTION_CHARS:
            continue
        prompt = _request(node, owner, doc)
        out.append(Conversation(relpath, qualname, first, split, prompt, code))
    return out


def build_corpus(root: Path | None = None) -> list[Conversation]:
    """All conversations, in file then line order, deduplicated by answer text.

    Files are processed in sorted order and the first copy of an answer is kept; a held-out
    function whose code also occurs in a training file is dropped, so the held-out split
    shares neither files nor code with training.
    """
    root = root or stdlib_root()
    per_split: dict[str, list[Conversation]] = {"train": [], "heldout": []}
    for relpath in stdlib_files(root):
        for conv in conversations_of_file(root, relpath):
            per_split[conv.split].append(conv)
    seen: set[str] = set()
    kept: list[Conversation] = []
    for split in ("train", "heldout"):
        for conv in per_split[split]:
            if conv.answer not in seen:
                seen.add(conv.answer)
                kept.append(conv)
    return sorted(kept, key=lambda c: (c.source, c.lineno, c.name))


def stdlib_fingerprint(root: Path) -> str:
    """sha256 over the names and contents of the files build_corpus reads (its only input)."""
    h = hashlib.sha256()
    for relpath in stdlib_files(root):
        h.update(relpath.encode() + b"\0" + hashlib.sha256((root / relpath).read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def corpus_fingerprint(corpus: Sequence[Conversation]) -> str:
    """sha256 over every conversation (source, split, messages, name, line), in corpus order."""
    h = hashlib.sha256()
    for conv in corpus:
        h.update(json.dumps(conv.to_json(), sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def check_subset(heldout: Sequence[Conversation], n: int) -> list[Conversation]:
    """A fixed, well-spread subset: the n held-out conversations with the smallest answer hash."""
    return sorted(heldout, key=lambda c: hashlib.sha256(c.answer.encode()).hexdigest())[:n]


def write_corpus_jsonl(conversations: Sequence[Conversation], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for conv in conversations:
            f.write(json.dumps(conv.to_json(), ensure_ascii=False) + "\n")


# --- Tokenizer ---------------------------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the ChatML special tokens and chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
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


def render(tokenizer: PreTrainedTokenizerFast, conv: Conversation) -> str:
    return tokenizer.apply_chat_template(conv.messages, tokenize=False)


def prompt_text(tokenizer: PreTrainedTokenizerFast, conv: Conversation) -> str:
    """The conversation up to and including the assistant header, as served for generation."""
    return tokenizer.apply_chat_template(
        conv.messages[:1], tokenize=False, add_generation_prompt=True
    )


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    answer_mask: list[int]  # 1 on the answer's tokens and its closing <|im_end|>


def encode(tokenizer: PreTrainedTokenizerFast, conv: Conversation) -> Encoded:
    """Token ids as the served model sees them: prompt, then the answer it generates, then '\\n'.

    Special tokens split the text, so encoding the pieces equals encoding the rendered string.
    """
    prompt = tokenizer.encode(prompt_text(tokenizer, conv), add_special_tokens=False)
    answer = tokenizer.encode(conv.answer + IM_END, add_special_tokens=False)
    tail = tokenizer.encode("\n", add_special_tokens=False)
    ids = prompt + answer + tail
    mask = [0] * len(prompt) + [1] * len(answer) + [0] * len(tail)
    return Encoded(ids, mask)


def encode_all(
    tokenizer: PreTrainedTokenizerFast, convs: Sequence[Conversation], max_len: int = MAX_SEQ_LEN
) -> list[Encoded]:
    """Encoded conversations of at most max_len tokens (longer ones are left out)."""
    encoded = (encode(tokenizer, c) for c in convs)
    return [e for e in encoded if len(e.ids) <= max_len]


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


def length_batches(encoded: Sequence[Encoded], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by similar length so that batch_size * longest <= batch_tokens."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i].ids), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(encoded[i].ids)  # ascending order: the newest is the longest
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def collate(
    encoded: Sequence[Encoded], indices: Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, answer_mask), each [B, T]."""
    longest = max(len(encoded[i].ids) for i in indices)
    ids = torch.full((len(indices), longest), pad_id, dtype=torch.long)
    attn = torch.zeros((len(indices), longest), dtype=torch.long)
    answer = torch.zeros((len(indices), longest), dtype=torch.long)
    for row, i in enumerate(indices):
        n = len(encoded[i].ids)
        ids[row, :n] = torch.tensor(encoded[i].ids)
        attn[row, :n] = 1
        answer[row, :n] = torch.tensor(encoded[i].answer_mask)
    return ids, attn, answer


def answer_token_losses(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, answer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token next-token CE (nats) on answer tokens: (sum of losses, number of tokens)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    targets = ids[:, 1:]
    weights = answer[:, 1:].float()
    losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (losses * weights).sum(), weights.sum()


@torch.no_grad()
def answer_ce(
    model: torch.nn.Module, encoded: Sequence[Encoded], pad_id: int, batch_tokens: int = 8192
) -> tuple[float, int]:
    """Mean CE (nats/token) of the model on the answers of `encoded`, and the token count."""
    model.eval()
    total, count = 0.0, 0.0
    for indices in length_batches(encoded, batch_tokens):
        loss_sum, n = answer_token_losses(model, *collate(encoded, indices, pad_id))
        total += loss_sum.item()
        count += n.item()
    return total / count, int(count)


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


# --- Generation --------------------------------------------------------------------------------


@torch.no_grad()
def greedy_generate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    conv: Conversation,
    max_new_tokens: int = 128,
) -> list[int]:
    """Greedy continuation token ids of the conversation's prompt (stops after <|im_end|>)."""
    ids = tokenizer.encode(prompt_text(tokenizer, conv), add_special_tokens=False)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )
    return out[0, len(ids) :].tolist()


# --- Loading the shipped target ----------------------------------------------------------------


def load_target(target_dir: Path = TARGET_DIR) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(target_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        target_dir, local_files_only=True, dtype=torch.float32
    )
    model.eval()
    return model, tokenizer


def heldout_answer_ce(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    heldout: Sequence[Conversation],
    n: int,
) -> tuple[float, int]:
    """Answer CE on the fixed check subset of n held-out conversations."""
    encoded = encode_all(tokenizer, check_subset(heldout, n))
    return answer_ce(model, encoded, tokenizer.pad_token_id)


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
