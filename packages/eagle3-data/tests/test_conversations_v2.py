"""conversations v2 (issue 42): agent records (tools, tool calls with ids, tool results,
reasoning) ingest, round-trip and validate; malformed ones are refused naming the line and
the field; the content id covers every field; version 1 files are still read."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3_data.config import IngestConfig
from eagle3_data.ingest import run
from eagle3_schemas import validate
from eagle3_schemas.contract.header import Header, write_parquet
from eagle3_schemas.io.fingerprint import canonical_json
from eagle3_schemas.layouts.conversations import (
    conversation_id,
    conversation_problem,
    iter_rows,
    template_kwargs,
)

from support.chat_tools import WEATHER_TOOLS

AGENT = {
    "tools": WEATHER_TOOLS,
    "messages": [
        {"role": "system", "content": "You are Kimi."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I need both cities.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "functions.get_weather:1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:1", "content": "Rome: 20 C"},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Paris: 12 C"},
        {"role": "assistant", "content": "Paris 12 C, Rome 20 C.", "reasoning_content": "Done."},
    ],
}
SHAREGPT_AGENT = {
    "tools": json.dumps([WEATHER_TOOLS[0]["function"]]),  # LLaMA-Factory: bare functions, JSON text
    "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {
            "from": "function_call",
            "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        },
        {"from": "observation", "value": "Oslo: -3 C"},
        {"from": "gpt", "value": "It is -3 C in Oslo."},
    ],
}


def _ingest(tmp_path: Path, records: list[object]) -> tuple[list[dict], list[dict]]:
    raw = tmp_path / "agent.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out, rejects = tmp_path / "conv.parquet", tmp_path / "rejects.jsonl"
    run(IngestConfig([raw], out, rejects))
    assert validate(out) == []
    return list(iter_rows(out)), [json.loads(x) for x in rejects.read_text().splitlines()]


def test_openai_agent_record_round_trips(tmp_path: Path) -> None:
    (row,), rejected = _ingest(tmp_path, [AGENT])
    assert rejected == []
    assert row["mode"] == "thinking" and json.loads(row["tools"]) == WEATHER_TOOLS
    want = copy.deepcopy(AGENT["messages"])
    want[2]["tool_calls"][1]["function"]["arguments"] = '{"city": "Rome"}'  # objects become JSON
    assert row["messages"] == want
    assert row["id"] == conversation_id(want, row["tools"], "thinking")


def test_tools_keep_the_sources_key_order_and_render_as_vllm_serves_them(
    tmp_path: Path,
) -> None:
    """Stored as written (vLLM keeps a request's order inside parameters); rendered in vLLM's
    order: type, function {name, description, parameters}, null where missing, unknown keys
    dropped (tests/test_tools_as_served.py checks the ids against vLLM itself)."""
    parameters = {"required": ["city"], "type": "object", "properties": {"city": {}}}
    tools = [
        {"function": {"parameters": parameters, "name": "get_weather"}, "x-owner": "me"},
        {"type": "function", "function": {"strict": True, "description": "Now.", "name": "now"}},
    ]
    (row,), _ = _ingest(tmp_path, [{**AGENT, "tools": tools}])
    assert row["tools"] == json.dumps(tools)
    assert json.dumps(template_kwargs(row["tools"], row["mode"])["tools"]) == json.dumps(
        [
            {
                "type": "function",
                "function": {"name": "get_weather", "description": None, "parameters": parameters},
            },
            {
                "type": "function",
                "function": {
                    "name": "now",
                    "description": "Now.",
                    "parameters": None,
                    "strict": True,
                },
            },
        ]
    )


def test_sharegpt_function_call_and_observation(tmp_path: Path) -> None:
    (row,), rejected = _ingest(tmp_path, [SHAREGPT_AGENT])
    assert rejected == []
    assert row["mode"] == "instant" and json.loads(row["tools"]) == WEATHER_TOOLS
    assert row["messages"] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "content": "Oslo: -3 C", "tool_call_id": "call_0", "name": "get_weather"},
        {"role": "assistant", "content": "It is -3 C in Oslo."},
    ]


def _broken(change) -> dict:
    record = copy.deepcopy(AGENT)
    change(record)
    return record


BAD = [
    (
        _broken(lambda r: r["messages"][2]["tool_calls"][0].pop("id")),
        "bad_tool_call: turn 2: field tool_calls[0].id: a tool call needs an id",
    ),
    (
        _broken(lambda r: r["messages"][3].__setitem__("tool_call_id", "functions.nope:9")),
        "unmatched_tool_result: message 3: tool_call_id 'functions.nope:9' answers no pending call",
    ),
    (
        _broken(
            lambda r: r["messages"][2]["tool_calls"][0]["function"].__setitem__(
                "arguments", "{city: Paris"
            )
        ),
        "bad_tool_call: turn 2: field tool_calls[0].function.arguments: not JSON",
    ),
    (
        _broken(lambda r: r["messages"].insert(4, {"role": "user", "content": "hurry"})),
        "not_alternating: message 4: role 'user' while calls ['functions.get_weather:0'] have no tool result",
    ),
    (_broken(lambda r: r.__setitem__("tools", "[{")), "bad_tools: field tools: not JSON"),
    (
        _broken(lambda r: r["tools"][0]["function"].__setitem__("description", 7)),
        "bad_tools: field tools[0].function.description: expected text or null, found int",
    ),
    (
        _broken(lambda r: r["tools"][0].__setitem__("type", "retrieval")),
        "bad_tools: field tools[0].type: 'retrieval' (vLLM serves only 'function')",
    ),
    (
        {"conversations": [{"from": "human", "value": "x"}, {"from": "observation", "value": "y"}]},
        "unmatched_tool_result: turn 1 (observation): no call is waiting for a result",
    ),
]


def test_malformed_agent_records_are_refused_naming_line_and_field(tmp_path: Path) -> None:
    rows, rejected = _ingest(tmp_path, [AGENT, *(r for r, _ in BAD)])
    assert len(rows) == 1
    assert [r["source"] for r in rejected] == [f"agent.jsonl:{n}" for n in range(2, 2 + len(BAD))]
    for got, (_, want) in zip(rejected, BAD, strict=True):
        assert got["reason"].startswith(want), (got["reason"], want)


def test_a_conversation_may_end_at_a_call_without_result() -> None:
    messages = copy.deepcopy(AGENT["messages"][:3])
    messages[2]["tool_calls"][1]["function"]["arguments"] = '{"city": "Rome"}'
    assert conversation_problem(messages) is None
    assert conversation_problem(messages, version=1).startswith("empty_turn")


PLAIN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def test_a_plain_row_keeps_its_version_1_id() -> None:
    # sha256 of the canonical [{role, content}] list, as conversations v1 defined it
    assert conversation_id(PLAIN) == hashlib.sha256(canonical_json(PLAIN)).hexdigest()[:32]
    assert conversation_id(PLAIN, "[]", "thinking") != conversation_id(PLAIN)


@settings(max_examples=60, deadline=None)
@given(
    turn=st.integers(min_value=0, max_value=len(AGENT["messages"]) - 1),
    # spelled out, not ID_FIELDS: a field dropped from the id must fail here
    field=st.sampled_from(
        ["reasoning_content", "tool_calls", "tool_call_id", "name", "content", "tools", "mode"]
    ),
    value=st.text(min_size=1, max_size=8),
)
def test_the_id_covers_every_field(turn: int, field: str, value: str) -> None:
    messages = copy.deepcopy(AGENT["messages"])
    tools, mode = json.dumps(WEATHER_TOOLS), "thinking"
    before = conversation_id(messages, tools, mode)
    if field == "tools":
        tools = json.dumps([*WEATHER_TOOLS, {"type": "function", "function": {"name": value}}])
    elif field == "mode":
        mode = "instant"
    elif field == "tool_calls":
        messages[turn]["tool_calls"] = [
            {"id": value, "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]
    else:
        if messages[turn].get(field) == value:
            value += "x"
        messages[turn][field] = value
    assert conversation_id(messages, tools, mode) != before
    # the token ids are not content: regeneration adds them and keeps the id
    messages[turn]["completion_token_ids"] = [1, 2, 3]
    assert conversation_id(messages, tools, mode) == conversation_id(
        [{k: v for k, v in m.items() if k != "completion_token_ids"} for m in messages],
        tools,
        mode,
    )


def test_version_1_files_are_still_read(tmp_path: Path) -> None:
    path = tmp_path / "v1.parquet"
    message = pa.struct([("role", pa.string()), ("content", pa.string())])
    table = pa.table(
        {"id": [conversation_id(PLAIN)], "messages": [PLAIN], "source": ["old.jsonl:1"]},
        schema=pa.schema(
            [("id", pa.string()), ("messages", pa.list_(message)), ("source", pa.string())]
        ),
    )
    lineage = {"source_fingerprint": "sha256:old", "generator": "original"}
    header = Header("conversations", 1, lineage, {"num_rows": 1, "num_rejected": 0})
    write_parquet(path, table, header)
    assert validate(path) == []
    assert list(iter_rows(path)) == [
        {
            "id": conversation_id(PLAIN),
            "source": "old.jsonl:1",
            "messages": PLAIN,
            "tools": "[]",
            "mode": "instant",
        }
    ]
    # version 1 knows no tool role: a v1 file holding one is refused by v1's rules
    table = table.set_column(
        1, "messages", pa.array([[*PLAIN, {"role": "tool", "content": "x"}]], pa.list_(message))
    )
    write_parquet(path, table, header)
    (violation,) = validate(path)
    assert "unknown_role: message 2" in violation.message
