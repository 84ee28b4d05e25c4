"""The agent corpus (tests/support/agent_corpus.py): seeded, readable by ingest under the v2
conversation rules, every tool result the world's, and a held-out share of each kind."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from eagle3_data.ingest import normalise
from eagle3_schemas.layouts.conversations import conversation_problem

from support import agent_corpus
from support.agent_corpus import (
    KINDS,
    TOOL_NAMES,
    build_agent_corpus,
    calculate,
    corpus_fingerprint,
    shop,
)

ROWS = 900


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return build_agent_corpus(ROWS, seed=0)


def test_the_seed_alone_makes_the_corpus(rows: list[dict]) -> None:
    assert corpus_fingerprint(build_agent_corpus(ROWS, seed=0)) == corpus_fingerprint(rows)
    assert corpus_fingerprint(build_agent_corpus(ROWS, seed=1)) != corpus_fingerprint(rows)
    assert len({json.dumps(r["messages"], sort_keys=True) for r in rows}) == ROWS


def test_every_row_is_read_by_ingest_in_its_kinds_mode(rows: list[dict]) -> None:
    modes: Counter[tuple[str, str]] = Counter()
    for row in rows:
        read = normalise(row)
        assert not isinstance(read, str), f"{row['source']}: {read}"
        messages, tools, mode = read
        assert conversation_problem(messages) is None, row["source"]
        assert (json.loads(tools) != []) == (row["kind"] == "agent"), row["source"]
        modes[(row["kind"], mode)] += 1
    assert modes[("instant", "thinking")] == modes[("thinking", "instant")] == 0
    # agent rows: mostly thinking, some in instant mode with tools (Kimi serves both)
    assert modes[("agent", "thinking")] > 3 * modes[("agent", "instant")] > 0


def test_every_tool_turn_is_the_worlds_answer_to_its_call(rows: list[dict]) -> None:
    world = shop(0)
    loops = 0
    for row in (r for r in rows if r["kind"] == "agent"):
        calls = {}
        for turn in row["messages"]:
            for call in turn.get("tool_calls", ()):
                name = call["function"]["name"]
                assert name in TOOL_NAMES and call["id"].startswith(f"functions.{name}:")
                calls[call["id"]] = call
            if turn["role"] == "tool":
                call = calls[turn["tool_call_id"]]
                args, result = (
                    json.loads(call["function"]["arguments"]),
                    json.loads(turn["content"]),
                )
                assert turn["name"] == call["function"]["name"]
                if turn["name"] == "get_price":
                    assert result["price"] == world[args["item"]].price
                elif turn["name"] == "get_stock":
                    assert result["in_stock"] == world[args["item"]].stock
                else:  # the generated expressions are "COUNT * CENTS"
                    count, cents = map(int, args["expression"].split(" * "))
                    assert result["result"] == count * cents
        indices = [int(i.rsplit(":", 1)[1]) for i in calls]
        assert indices == list(range(len(calls))), row["source"]  # Kimi numbers the calls
        loops += sum(t["role"] == "user" for t in row["messages"]) > 1
    assert loops > 0  # multi-turn agent loops are in


def test_each_kind_has_a_held_out_share(rows: list[dict]) -> None:
    for kind in KINDS:
        of_kind = [r for r in rows if r["kind"] == kind]
        share = sum(r["split"] == "heldout" for r in of_kind) / len(of_kind)
        assert 0.01 < share < 0.12, (kind, share)


def test_the_calculator_computes_and_refuses_anything_else() -> None:
    assert calculate("12 * (3435 - 5) + -2") == 12 * (3435 - 5) - 2
    for bad in ("__import__('os')", "2 ** 10", "7 / 2", "1.5 * 2", "", "x + 1"):
        with pytest.raises(ValueError, match="not an integer expression"):
            calculate(bad)


def test_the_command_writes_the_file_whole(tmp_path: Path) -> None:
    out = tmp_path / "agent.jsonl"
    assert agent_corpus.main([str(out), "--conversations", "30", "--seed", "3"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert written == build_agent_corpus(30, seed=3)
    assert not list(tmp_path.glob("*.partial"))
