"""Thinking and agent rows tokenize per generation event (issue 42): the prompt as served with
its generation prompt (loss 0), then the completion (loss 1) holding the reasoning, the tool
call markers and the end token; token ids kept by regeneration are used as they are."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_data.config import TokenizeConfig
from eagle3_data.loss_mask import ChatRenderer
from eagle3_data.tokenization import encode_batch, load_tokenizer, run
from eagle3_schemas import read_header, validate
from eagle3_schemas.contract.header import make_header, write_parquet
from eagle3_schemas.layouts.conversations import SCHEMA, conversation_id

from support.chat_tools import WEATHER_TOOLS

CALL = {
    "id": "call_0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
AGENT = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should look it up.",
        "tool_calls": [CALL],
    },
    {"role": "tool", "content": "Paris: 12 C", "tool_call_id": "call_0", "name": "get_weather"},
    {"role": "assistant", "content": "It is 12 C.", "reasoning_content": "The tool said 12."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome.", "reasoning_content": "Be polite."},
]


def _served_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """What vLLM's chat endpoint feeds the target for the next turn in thinking mode."""
    text = tokenizer.apply_chat_template(
        messages,
        tools=WEATHER_TOOLS,
        add_generation_prompt=True,
        enable_thinking=True,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)  # as vLLM tokenizes a chat prompt


def test_qwen3_thinking_agent_row_is_one_sample_per_event(qwen3_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    renderer = ChatRenderer.for_tokenizer(tokenizer)
    rows = [("r", "t:0", AGENT, json.dumps(WEATHER_TOOLS), "thinking")]
    events = encode_batch(renderer, rows, max_length=4096)
    assert [e.sample_id for e in events] == ["r#0", "r#1", "r#2"]
    assert all(e.error is None for e in events), [e.error for e in events]
    completions = [
        '<think>\nI should look it up.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "<think>\nThe tool said 12.\n</think>\n\nIt is 12 C.<|im_end|>",
        "<think>\nBe polite.\n</think>\n\nYou are welcome.<|im_end|>",
    ]
    for e, turn, completion in zip(events, (1, 3, 5), completions, strict=True):
        prompt = _served_prompt(tokenizer, AGENT[:turn])
        n = len(prompt)
        # the mask is exactly the completion span: zeros over the served prompt, ones after
        assert e.input_ids[:n].tolist() == prompt
        assert e.loss_mask[:n].sum() == 0 and e.loss_mask[n:].all()
        assert tokenizer.decode(e.input_ids[n:]) == completion
        assert e.kinds["reasoning"] > 0 and sum(e.kinds.values()) == int(e.loss_mask.sum())
    assert events[0].kinds["tool_call"] > 0 and events[1].kinds["tool_call"] == 0


def _write(path: Path, rows: list[tuple[list[dict], str, str]]) -> Path:
    table = pa.table(
        {
            "id": [conversation_id(m, t, mode) for m, t, mode in rows],
            "messages": [m for m, _, _ in rows],
            "source": [f"t:{i}" for i in range(len(rows))],
            "tools": [t for _, t, _ in rows],
            "mode": [mode for _, _, mode in rows],
        },
        schema=SCHEMA,
    )
    lineage = {"source_fingerprint": "sha256:test", "generator": "original"}
    write_parquet(
        path, table, make_header("conversations", lineage, num_rows=len(rows), num_rejected=0)
    )
    return path


def test_token_ids_kept_by_regeneration_are_trained_as_they_are(
    qwen3_tokenizer_dir: Path, tmp_path: Path
) -> None:
    """The target's own ids, token for token: the mask covers exactly completion_token_ids,
    and the report counts reasoning, tool-call and answer tokens apart."""
    tokenizer = load_tokenizer(qwen3_tokenizer_dir)
    vocab = tokenizer.get_vocab()
    think, end_think = vocab["<think>"], vocab["</think>"]
    call_open, call_close, im_end = vocab["<tool_call>"], vocab["</tool_call>"], vocab["<|im_end|>"]
    with_ids = [dict(m) for m in AGENT[:3]]
    prompt = _served_prompt(tokenizer, AGENT[:1])
    completion = [think, 40, 41, end_think, 42, call_open, 43, 44, call_close, im_end]
    with_ids[1].update(prompt_token_ids=prompt, completion_token_ids=completion)
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    source = _write(
        tmp_path / "c.parquet",
        [(with_ids, json.dumps(WEATHER_TOOLS), "thinking"), (plain, "[]", "instant")],
    )
    out = tmp_path / "tok.parquet"
    summary = run(
        TokenizeConfig(source, qwen3_tokenizer_dir, out, tmp_path / "rej.jsonl", workers=1)
    )
    assert validate(out) == []
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [
        conversation_id(with_ids, json.dumps(WEATHER_TOOLS), "thinking") + "#0",
        conversation_id(plain),
    ]
    assert rows[0]["input_ids"] == prompt + completion
    assert rows[0]["loss_mask"] == [0] * len(prompt) + [1] * len(completion)
    assert summary.events == 1
    kinds = read_header(out).fields["loss_tokens_by_kind"]
    answer_of_plain = int(np.sum(rows[1]["loss_mask"]))
    assert kinds == {"reasoning": 4, "tool_call": 4, "answer": 2 + answer_of_plain}
