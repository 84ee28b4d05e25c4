"""Declared tools reach the chat template as vLLM serves them: the prompt ids eagle3-data
(ingest, tokenize) and eagle3-eval render for tool rows equal, token for token, the ids vLLM's
own chat request path renders for the same requests with the same tokenizer.

vLLM hands the template each tool's ``ChatCompletionToolsParam.model_dump()`` (type, then
function {name, description, parameters, ...}; a missing description is null; unknown keys
dropped; ``parameters`` in the request's own order). Kimi's template renders ``tools | tojson``
key by key, so a key order vLLM never serves (ingest once sorted the keys) trains the draft on
prompts no user sends.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from eagle3_data.config import IngestConfig, TokenizeConfig
from eagle3_data.ingest import run as ingest
from eagle3_data.tokenization import load_tokenizer
from eagle3_data.tokenization import run as tokenize
from eagle3_eval.prompts import PromptSelection, PromptSource, build_prompt_set
from eagle3_schemas.layouts.conversations import iter_rows, served_tools

from support import agent_corpus, kimi_standin
from support.agent_target import TARGET_DIR as AGENT_TARGET

ROOT = Path(__file__).resolve().parents[1]

# Keys in an order of a user's choosing, never vLLM's: nested parameters, strict, a tool-level
# key vLLM drops, a tool without description or parameters.
SEARCH = {
    "function": {
        "parameters": {
            "properties": {
                "query": {"type": "string", "description": "What to look for."},
                "filters": {
                    "type": "object",
                    "properties": {
                        "max_price": {"type": "number"},
                        "colours": {
                            "type": "array",
                            "items": {"enum": ["red", "blue"], "type": "string"},
                        },
                    },
                    "required": ["max_price"],
                },
            },
            "type": "object",
            "required": ["query"],
        },
        "strict": True,
        "name": "search_shop",
        "description": "Search the shop's items.",
    },
    "type": "function",
}
GET_PRICE = {
    "x-owner": "shop",
    "type": "function",
    "function": {
        "description": "The unit price of an item, in euros.",
        "name": "get_price",
        "parameters": {
            "type": "object",
            "required": ["item"],
            "properties": {"item": {"type": "string"}},
        },
    },
}
PING = {"type": "function", "function": {"name": "ping"}}


def _call(i: int, name: str, arguments: str) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    return {"id": f"functions.{name}:{i}", "type": "function", "function": function}


RECORDS = [
    {  # thinking: reasons, calls a tool, answers
        "tools": [SEARCH, GET_PRICE, PING],
        "messages": [
            {"role": "user", "content": "Find me a red lamp under 20 euros."},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Search with a price filter.",
                "tool_calls": [
                    _call(
                        0,
                        "search_shop",
                        json.dumps(
                            {"query": "lamp", "filters": {"max_price": 20, "colours": ["red"]}}
                        ),
                    )
                ],
            },
            {"role": "tool", "tool_call_id": "functions.search_shop:0", "content": '["red lamp"]'},
            {"role": "assistant", "content": "The red lamp.", "reasoning_content": "One hit."},
        ],
    },
    {  # instant: calls two tools at once, one without description or parameters; its arguments
        # compact and escaped, where vLLM renders a history call as json.dumps writes it
        "tools": [PING, GET_PRICE],
        "messages": [
            {"role": "system", "content": "You run a shop."},
            {"role": "user", "content": "Is the shop up, and what does the bleu \u00e9 cost?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    _call(0, "ping", "{}"),
                    _call(1, "get_price", '{"item":"bleu \\u00e9"}'),
                ],
            },
            {"role": "tool", "tool_call_id": "functions.ping:0", "content": "pong"},
            {"role": "tool", "tool_call_id": "functions.get_price:1", "content": "4.20"},
            {"role": "assistant", "content": "It is up; the bleu \u00e9 costs 4.20 euros."},
        ],
    },
]


def _mode(record: dict[str, Any]) -> str:
    return "thinking" if any(m.get("reasoning_content") for m in record["messages"]) else "instant"


def _requests(record: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat request a user sends at each assistant turn of ``record``, tools as written."""
    return [
        {
            "messages": record["messages"][:turn],
            "tools": record["tools"],
            "chat_template_kwargs": {"thinking": _mode(record) == "thinking"},
        }
        for turn, m in enumerate(record["messages"])
        if m["role"] == "assistant"
    ]


def vllm_prompt_ids(python: str, target: Path, requests: list[dict], tmp_path: Path) -> list:
    path = tmp_path / "requests.json"
    path.write_text(json.dumps(requests))
    done = subprocess.run(
        [python, "-m", "support.vllm_chat_render", str(target), str(path), "--trust-remote-code"],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "tests"), VLLM_LOGGING_LEVEL="WARNING"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def data_prompt_ids(target: Path, source: Path, tmp_path: Path) -> list[list[int]]:
    """Per record, per assistant turn: the prompt (loss 0) ids eagle3-data trains on."""
    conversations = tmp_path / "conversations.parquet"
    ingest(IngestConfig([source], conversations, tmp_path / "ingest.rejects.jsonl"))
    tokenized = tmp_path / "tokenized.parquet"
    summary = tokenize(
        TokenizeConfig(conversations, target, tokenized, tmp_path / "tokenize.rejects.jsonl",
                       max_length=4096, workers=1, trust_remote_code=True)
    )  # fmt: skip
    assert summary.written == sum(len(_requests(r)) for r in RECORDS)
    table = pq.read_table(tokenized).to_pydict()
    samples = dict(zip(table["id"], zip(table["input_ids"], table["loss_mask"], strict=True), strict=True))  # fmt: skip
    by_line = {row["source"]: row["id"] for row in iter_rows(conversations)}
    prompts = []
    for line, record in enumerate(RECORDS, start=1):
        for event in range(len(_requests(record))):
            ids, mask = samples[f"{by_line[f'{source.name}:{line}']}#{event}"]
            prompts.append(ids[: int(np.argmax(mask))])
    return prompts


def eval_prompt_ids(target: Path, source: Path) -> list[list[int]]:
    """Per record, its last assistant turn's prompt as eagle3-eval renders it."""
    tokenizer = load_tokenizer(target, trust_remote_code=True)
    selection = PromptSelection((PromptSource(None, source),))
    return [p.token_ids for p in build_prompt_set(selection, tokenizer).prompts]


@pytest.fixture(scope="module")
def kimi_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Kimi stand-in's tokenizer (Python TikToken code, 163,840 ids) and config, no weights."""
    out = tmp_path_factory.mktemp("kimi-tokenizer")
    kimi_standin.save_tokenizer(out, kimi_standin.bpe_ranks(kimi_standin.corpus_texts()))
    kimi_standin.save_wrapper_files(out, kimi_standin.standin_config(kimi_standin.target_facts()))
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("target", ["tiny-agent", "kimi-standin"])
def test_tool_prompts_are_the_ids_vllm_serves(
    target: str, vllm_python: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    target_dir = AGENT_TARGET if target == "tiny-agent" else request.getfixturevalue("kimi_tokenizer_dir")  # fmt: skip
    source = tmp_path / "agent.jsonl"
    source.write_text("".join(json.dumps({**r, "split": "heldout"}) + "\n" for r in RECORDS))
    requests = [q for r in RECORDS for q in _requests(r)]
    served = vllm_prompt_ids(vllm_python, target_dir, requests, tmp_path)
    assert len(served) == len(requests) == 4 and all(served)
    assert data_prompt_ids(target_dir, source, tmp_path) == served
    last_turns = [len(_requests(r)) - 1 for r in RECORDS]
    firsts = np.cumsum([0] + [len(_requests(r)) for r in RECORDS[:-1]])
    assert eval_prompt_ids(target_dir, source) == [served[f + k] for f, k in zip(firsts, last_turns, strict=True)]  # fmt: skip


def test_the_agent_target_was_trained_on_tools_as_vllm_serves_them() -> None:
    """Its corpus renders agent_corpus.TOOLS as given (tests/support/agent_target.render_prompt),
    already in the order and form vLLM serves."""
    served = served_tools(json.dumps(agent_corpus.TOOLS))
    assert json.dumps(served) == json.dumps(agent_corpus.TOOLS)  # keys and their order
