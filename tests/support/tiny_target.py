"""The embedded tiny Llama target (recipes/tiny/target) as its tests and builders read it.

Encoding a corpus conversation as served (prompt, answer, closing ``<|im_end|>``) with the answer
mask, answer cross-entropy on held-out conversations, greedy generation, and loading the
shipped directory. tools/targets/build_tiny_target.py trains the target with these; the tests
check the shipped one with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from support.tiny_corpus import Conversation, check_subset

TARGET_DIR = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "target"
BUILD_INFO = "build_info.json"
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # ends every turn; the eos token of generation
MAX_SEQ_LEN = 512  # conversations with more tokens are left out of training and evaluation
CHECK_CONVERSATIONS = 200  # held-out conversations scored by the builders' --check
# Held-out answer CE (nats/token) the shipped target must stay below: the unigram baseline on
# the same tokens (6.49) minus 1.5 nats. The build measured 4.72 ("check_subset_answer_ce" in
# recipes/tiny/target/build_info.json).
CHECK_MAX_CE = 5.0


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
