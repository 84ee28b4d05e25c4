"""Assistant-only loss masks: golden on the real Qwen3 tokenizer, equal to generation-tag masks
where a template has them, robust to quoted answers, truncation and parallel workers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from eagle3_data.config import TokenizeConfig
from eagle3_data.loss_mask import ChatRenderer
from eagle3_data.tokenization import Encoded, encode_batch, load_tokenizer, run
from eagle3_schemas import read_header, validate

THINKING = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Add?"},
    {"role": "assistant", "content": "<think>\nsum them\n</think>\n\n1+1=2"},
    {"role": "user", "content": "Mul?"},
    {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n2*2=4"},
]
QUOTED = [
    {"role": "user", "content": "Name a sort."},
    {"role": "assistant", "content": "sorted(xs)"},
    {"role": "user", "content": "Why did you say sorted(xs)?"},
    {"role": "assistant", "content": "sorted(xs)"},
]
PLAIN = [
    {"role": "user", "content": "def add(a, b):"},
    {"role": "assistant", "content": "    return a + b"},
]


def encode(
    renderer: ChatRenderer, sample_id: str, source: str, messages, max_length: int
) -> Encoded:
    """One whole-conversation row through ``encode_batch``."""
    return encode_batch(renderer, [(sample_id, source, messages)], max_length)[0]


def _masked_text(tokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decoded runs of consecutive masked tokens."""
    runs, current = [], []
    for token, m in zip(ids.tolist(), mask.tolist(), strict=True):
        if m:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def test_qwen3_golden_thinking_multi_turn(qwen3_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    renderer = ChatRenderer.for_tokenizer(tokenizer)
    assert renderer.closing == "<|im_end|>"
    enc = encode(renderer, "s", "test:0", THINKING, max_length=4096)
    assert enc.error is None
    assert tokenizer.decode(enc.input_ids) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nAdd?<|im_end|>\n"
        "<|im_start|>assistant\n1+1=2<|im_end|>\n<|im_start|>user\nMul?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nmultiply\n</think>\n\n2*2=4<|im_end|>\n"
    )
    # Qwen3 drops reasoning of earlier turns: only what the template renders is trained.
    assert _masked_text(tokenizer, enc.input_ids, enc.loss_mask) == [
        "1+1=2<|im_end|>",
        "<think>\nmultiply\n</think>\n\n2*2=4<|im_end|>",
    ]


def test_an_answer_quoted_by_the_user_is_not_trained(qwen3_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    enc = encode(ChatRenderer.for_tokenizer(tokenizer), "s", "t", QUOTED, max_length=4096)
    runs = _masked_text(tokenizer, enc.input_ids, enc.loss_mask)
    assert runs == ["sorted(xs)<|im_end|>", "sorted(xs)<|im_end|>"]
    text = tokenizer.decode(enc.input_ids)
    quoted_at = text.index("Why did you say sorted(xs)?")
    first_masked = int(np.flatnonzero(enc.loss_mask)[0])
    assert len(tokenizer.decode(enc.input_ids[:first_masked])) < quoted_at


@pytest.mark.parametrize(
    "conversation",
    [THINKING[:3], QUOTED, PLAIN, THINKING],
    ids=["system", "quoted", "plain", "thinking"],
)
def test_equals_generation_tag_masks_on_the_tiny_target(
    tiny_tokenizer_dir: Path, conversation: list[dict[str, str]]
) -> None:
    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    assert (
        "{% generation %}" in tokenizer.chat_template
        or "{%- generation %}" in tokenizer.chat_template
    )
    ours = encode(ChatRenderer.for_tokenizer(tokenizer), "s", "t", conversation, max_length=4096)
    tagged = tokenizer.apply_chat_template(
        conversation, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    assert ours.input_ids.tolist() == list(tagged["input_ids"])
    assert ours.loss_mask.tolist() == list(tagged["assistant_masks"])


def test_a_template_that_rewrites_answers_is_rejected_not_mis_masked(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    changed = tmp_path / "tok"
    shutil.copytree(qwen3_tokenizer_dir, changed)
    config = json.loads((changed / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + (m['content'] | upper) + '<|im_end|>\\n' }}{% endfor %}"
    )
    (changed / "tokenizer_config.json").write_text(json.dumps(config))
    enc = encode(
        ChatRenderer.for_tokenizer(load_tokenizer(changed)), "s", "t", PLAIN, max_length=4096
    )
    assert enc.error is not None and enc.error.startswith("template_mismatch: assistant turn 1")


def test_run_truncates_keeping_the_prefix_and_rejects_samples_left_without_answer(
    qwen3_tokenizer_dir: Path, tmp_path: Path, write_conversations
) -> None:
    long_answer = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": " ".join(map(str, range(200)))},
    ]
    long_prompt = [
        {"role": "user", "content": "word " * 300},
        {"role": "assistant", "content": "ok"},
    ]
    conversations = write_conversations(tmp_path / "c.parquet", [PLAIN, long_answer, long_prompt])
    out, rejects = tmp_path / "tok.parquet", tmp_path / "rej.jsonl"
    summary = run(
        TokenizeConfig(conversations, qwen3_tokenizer_dir, out, rejects, max_length=64, workers=1)
    )
    assert validate(out) == []
    assert (
        summary.written == 2
        and summary.truncated == 1
        and summary.rejected == {"no_loss_tokens": 1}
    )
    rows = pq.read_table(out).to_pylist()
    assert (
        rows[1]["num_tokens"] == 64
        and rows[1]["input_ids"][:3]
        == load_tokenizer(qwen3_tokenizer_dir)("<|im_start|>user\n")["input_ids"]
    )
    rejected = json.loads(rejects.read_text())
    assert rejected["source"] == "test:2" and "beyond max_length" in rejected["reason"]
    header = read_header(out)
    assert header.fields["truncation"] == "keep_prefix" and header.fields["vocab_size"] == 151669
    # whose answers: the conversations' generator, carried on to the dataset and the card
    assert header.fields["answers"] == {"generator": "original"}
    assert set(header.lineage) == {
        "conversations_fingerprint",
        "tokenizer_fingerprint",
        "chat_template_fingerprint",
        "trust_remote_code",  # false: a tokenizer without custom code
        "remote_code_files",
    }


@pytest.mark.process
def test_parallel_workers_write_the_same_rows_in_the_same_order(
    qwen3_tokenizer_dir: Path, tmp_path: Path, write_conversations
) -> None:
    conversations = [
        [
            {"role": "user", "content": f"Q{i}?"},
            {"role": "assistant", "content": f"A{i} " * (i % 7 + 1)},
        ]
        for i in range(60)
    ]
    source = write_conversations(tmp_path / "c.parquet", conversations)
    outputs = []
    for workers in (1, 2):
        out = tmp_path / f"tok{workers}.parquet"
        run(
            TokenizeConfig(
                source,
                qwen3_tokenizer_dir,
                out,
                tmp_path / f"r{workers}.jsonl",
                workers=workers,
                chunk_rows=7,
            )
        )
        outputs.append(pq.read_table(out).to_pylist())
    assert outputs[0] == outputs[1] and len(outputs[0]) == 60
