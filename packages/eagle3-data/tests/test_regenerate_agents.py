"""ingest → regenerate → tokenize for thinking and agent traffic (issue 42), against a local
OpenAI-compatible endpoint that behaves like vLLM serving a thinking model with its reasoning
and tool-call parsers and ``return_token_ids``: it renders each request with the real Qwen3
tokenizer's template (tools, mode, generation prompt), answers by script, and returns the
reasoning, the tool calls (with ids of its own) and the token ids.

Checked: the mode per row follows --thinking-fraction; the reasoning and the calls are kept;
each source result is spliced under the target's call id; a call with no source result left
ends the conversation; an answer cut at max_tokens is rejected unless kept; and tokenize's
rows are the served prompt ids (loss 0) then the completion ids (loss 1), token for token.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from eagle3_data import ingest, regenerate, tokenization
from eagle3_data.config import IngestConfig, RegenerateConfig, SamplingConfig, TokenizeConfig
from eagle3_data.tokenization import load_tokenizer
from eagle3_schemas import validate
from eagle3_schemas.layouts.conversations import iter_rows

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _call(source_id: str, city: str) -> dict[str, Any]:
    arguments = json.dumps({"city": city})
    return {
        "id": source_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


RECORDS = [
    {  # an agent turn: one call, its result, then the answer; then a plain follow-up
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("src_a", "Paris")]},
            {"role": "tool", "tool_call_id": "src_a", "content": "Paris: 12 C"},
            {"role": "assistant", "content": "Paris is at 12 C."},
            {"role": "user", "content": "Thanks!"},
            {"role": "assistant", "content": "Welcome."},
        ],
    },
    {  # the target calls twice where the source has one result: ends at the second call
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "Weather in Rome and Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [_call("src_b", "Rome")]},
            {"role": "tool", "tool_call_id": "src_b", "content": "Rome: 20 C"},
            {"role": "assistant", "content": "Rome is at 20 C."},
        ],
    },
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]},
    {
        "messages": [
            {"role": "user", "content": "Long story?"},
            {"role": "assistant", "content": "x"},
        ]
    },
]


class Target:
    """The scripted target: what it answers, and every request it got."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: list[dict[str, Any]] = []
        self.issued: list[str] = []  # call ids the target issued, in order
        self.lock = threading.Lock()

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        messages, tools = body["messages"], body.get("tools")
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking", True)
        prompt = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
        last = messages[-1]
        calls, finish = [], "stop"
        if last["role"] == "tool":
            issued = {c["id"] for m in messages for c in m.get("tool_calls") or []}
            assert last["tool_call_id"] in issued, (
                f"result under {last['tool_call_id']!r}, not a call id the target issued"
            )
            reasoning, content = "The tool answered.", f"It is {last['content'].split(': ')[1]}."
        elif last["content"].startswith("Weather in"):
            cities = last["content"][len("Weather in ") : -1].split(" and ")
            with self.lock:
                ids = [f"chatcmpl-tool-{len(self.issued) + k}" for k in range(len(cities))]
                self.issued += ids
            calls = [_call(i, c) for i, c in zip(ids, cities, strict=True)]
            reasoning, content, finish = "I should call the tool.", "", "tool_calls"
        elif last["content"] == "Long story?":
            reasoning, content, finish = "Once upon", "a time", "length"
        else:
            reasoning, content = "Be brief.", "Sure, " + last["content"].lower()
        # the completion as the target generates it after Qwen3's generation prompt
        text = f"<think>\n{reasoning}\n</think>\n\n" if thinking else ""
        text += content + "".join(
            '<tool_call>\n{"name": "get_weather", "arguments": '
            + c["function"]["arguments"]
            + "}\n</tool_call>"
            for c in calls
        )
        text += "<|im_end|>"
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if thinking:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        encode = lambda t: self.tokenizer.encode(t, add_special_tokens=False)  # noqa: E731
        with self.lock:
            self.requests.append(body)
        return {
            "prompt_token_ids": encode(prompt),
            "choices": [{"message": message, "finish_reason": finish, "token_ids": encode(text)}],
        }


@pytest.fixture
def target(qwen3_tokenizer_dir: Path) -> Iterator[tuple[str, Target]]:
    state = Target(load_tokenizer(qwen3_tokenizer_dir))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                status, payload = 200, state.answer(body)
            except AssertionError as e:
                status, payload = 400, {"error": str(e)}
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", state
    server.shutdown()
    server.server_close()


def _pipeline(tmp_path: Path, url: str, tokenizer_dir: Path, **regen: Any) -> tuple[Any, Path]:
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    conv = tmp_path / "c.parquet"
    ingest.run(IngestConfig([raw], conv, tmp_path / "c.rejects.jsonl"))
    out = tmp_path / "r.parquet"
    config = RegenerateConfig(
        conv, out, tmp_path / "r.rejects.jsonl", "target", url, retries=0, **regen
    )
    summary = regenerate.run(config)
    assert summary.published and validate(out) == []
    return summary, out


def test_thinking_agent_round_trip(target, tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    url, state = target
    summary, out = _pipeline(
        tmp_path,
        url,
        qwen3_tokenizer_dir,
        thinking_fraction=1.0,
        sampling=SamplingConfig(max_tokens=64),
    )
    assert (summary.regenerated, summary.rejected, summary.failed) == (3, 1, 0)
    assert all(r["chat_template_kwargs"]["enable_thinking"] is True for r in state.requests)
    assert all(
        r["tools"] == TOOLS for r in state.requests if "Weather" in r["messages"][0]["content"]
    )
    rows = {r["messages"][0]["content"]: r for r in iter_rows(out)}
    assert set(rows) == {"Weather in Paris?", "Weather in Rome and Oslo?", "Say hi."}
    assert all(r["mode"] == "thinking" for r in rows.values())
    paris = rows["Weather in Paris?"]["messages"]
    assert [m["role"] for m in paris] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    call = paris[1]["tool_calls"][0]
    assert call["id"] == "chatcmpl-tool-0" or call["id"].startswith("chatcmpl-tool-")
    # the source's result, under the target's call id and name
    assert paris[2] == {
        "role": "tool",
        "content": "Paris: 12 C",
        "tool_call_id": call["id"],
        "name": "get_weather",
    }
    assert [m.get("reasoning_content") for m in paris if m["role"] == "assistant"] == [
        "I should call the tool.",
        "The tool answered.",
        "Be brief.",
    ]
    assert paris[3]["content"] == "It is 12 C." and paris[5]["content"] == "Sure, thanks!"
    # two calls, one source result: the first is answered, the conversation ends at the second
    rome = rows["Weather in Rome and Oslo?"]["messages"]
    assert [m["role"] for m in rome] == ["user", "assistant", "tool"]
    assert (
        rome[2]["tool_call_id"] == rome[1]["tool_calls"][0]["id"]
        and rome[2]["content"] == "Rome: 20 C"
    )

    tokenized = tmp_path / "t.parquet"
    tokenization.run(
        TokenizeConfig(
            out,
            qwen3_tokenizer_dir,
            tokenized,
            tmp_path / "t.rej.jsonl",
            max_length=4096,
            workers=1,
        )
    )
    assert validate(tokenized) == []
    samples = {r["id"]: r for r in pq.read_table(tokenized).to_pylist()}
    expected = 0
    for row in rows.values():
        events = [m for m in row["messages"] if m["role"] == "assistant"]
        for k, m in enumerate(events):
            sample = samples[f"{row['id']}#{k}"]
            # token for token: the served prompt, loss 0, then what the target generated, loss 1
            assert sample["input_ids"] == m["prompt_token_ids"] + m["completion_token_ids"]
            assert sample["loss_mask"] == [0] * len(m["prompt_token_ids"]) + [1] * len(
                m["completion_token_ids"]
            )
            expected += 1
    assert len(samples) == expected == 3 + 1 + 1


def test_mode_mix_and_length_cut(target, tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    url, _ = target
    summary, out = _pipeline(
        tmp_path,
        url,
        qwen3_tokenizer_dir,
        thinking_fraction=0.5,
        keep_length_cut=True,
        sampling=SamplingConfig(seed=3),
    )
    assert (summary.regenerated, summary.rejected, summary.kept_length_cut) == (4, 0, 1)
    rows = list(iter_rows(out))
    modes = {r["id"]: r["mode"] for r in rows}
    config = RegenerateConfig(
        out, out, out, "m", sampling=SamplingConfig(seed=3), thinking_fraction=0.5
    )
    assert modes == {i: regenerate.row_mode(config, i, "instant") for i in modes}
    assert set(modes.values()) == {"thinking", "instant"}  # seed 3 draws both here
    for row in rows:
        thinking = row["mode"] == "thinking"
        for m in row["messages"]:
            if m["role"] == "assistant":
                assert ("reasoning_content" in m) == thinking
    long = next(r for r in rows if r["messages"][0]["content"] == "Long story?")
    assert long["messages"][1]["content"] == "a time"
