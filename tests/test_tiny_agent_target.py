"""The embedded agent target (recipes/tiny-agent/target): thinks and calls tools in Kimi-K2.5's
chat format, really trained (tools/targets/build_tiny_agent_target.py, issue 43).

These tests read the shipped directory and check that it is what its card says: Kimi's special
tokens and template, a corpus that the seed alone rebuilds on any Python, small enough to travel
to a lent GPU, and on held-out rows it learned each kind of traffic: completion CE per kind below
the bound, and greedy tool calls that parse and name a declared tool.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from support import agent_corpus
from support import agent_target as target
from support.kimi_standin import FILES as KIMI_FILES

ROOT = Path(__file__).resolve().parents[1]
TARGET = target.TARGET_DIR

# vLLM's parsers read 30 of 30 at the build (1.0); the floor leaves 3 of 30 to library updates.
TOOL_CALLS_READ_FLOOR = 0.9


@pytest.fixture(scope="module")
def build_info() -> dict:
    return json.loads((TARGET / target.BUILD_INFO).read_text())


@pytest.fixture(scope="module")
def shipped() -> tuple:
    torch.set_num_threads(2)
    return target.load_target(TARGET)


@pytest.fixture(scope="module")
def rows(build_info: dict) -> list[dict]:
    return agent_corpus.build_agent_corpus(seed=build_info["seed"])


def test_kimis_special_tokens_are_single_tokens_and_its_template_is_kimis(shipped: tuple) -> None:
    _, tokenizer = shipped
    for token in target.SPECIAL_TOKENS:
        assert tokenizer.convert_ids_to_tokens(tokenizer.encode(token, add_special_tokens=False)) == [token]  # fmt: skip
    assert tokenizer.chat_template == (KIMI_FILES / "chat_template.jinja").read_text()
    assert tokenizer.eos_token == "<|im_end|>"


def test_the_seed_alone_rebuilds_its_corpus_and_heldout_rows(build_info: dict, rows: list) -> None:
    assert agent_corpus.corpus_fingerprint(rows) == build_info["corpus_fingerprint"]
    heldout = sorted(r["source"] for r in rows if r["split"] == "heldout")
    assert heldout == build_info["heldout_sources"]
    assert {r["kind"] for r in rows if r["source"] in set(heldout)} == set(agent_corpus.KINDS)


def test_it_is_small_enough_to_travel_to_a_lent_gpu(build_info: dict) -> None:
    size = sum(p.stat().st_size for p in TARGET.iterdir() if p.is_file())
    assert size < 8 * 2**20, size  # the repository travels in 64 MiB (tools/gpu/gpu_check.sh)
    assert build_info["parameters"] < 2_000_000


def test_an_events_prompt_extends_the_previous_events_text(shipped: tuple, rows: list) -> None:
    """Within one question an event's prompt is the previous prompt + completion + the tool
    turns (so one sequence trains both); a follow-up question starts afresh (Kimi drops the
    earlier reasoning)."""
    _, tokenizer = shipped
    loop = next(
        r for r in rows
        if r["kind"] == "agent" and sum(m["role"] == "user" for m in r["messages"]) > 1
        and target.thinking(r)
    )  # fmt: skip
    events = target.events(tokenizer, loop)
    joined = [events[i + 1][0].startswith(p + c) for i, (p, c) in enumerate(events[:-1])]
    assert joined[0] and not all(joined)
    encoded = target.encode_row(tokenizer, loop)
    assert len(encoded) == joined.count(False) + 1
    completions = sum(len(tokenizer.encode(c, add_special_tokens=False)) for _, c in events)
    assert sum(sum(e.answer_mask) for e in encoded) == completions


def test_it_learned_each_kind_of_traffic(shipped: tuple, rows: list, build_info: dict) -> None:
    model, tokenizer = shipped
    ce = target.ce_per_kind(model, tokenizer, rows)
    assert ce == pytest.approx(build_info["heldout_ce_per_kind"], abs=1e-3)
    assert target.check_failures(ce, build_info["unigram_ce_per_kind"]) == []
    # and its tool calls: every held-out first call well formed at the build (79 of 79)
    assert build_info["tool_calls"]["tool_calls_well_formed"] == 1.0


@pytest.mark.vllm
def test_vllms_kimi_k2_parsers_read_its_own_tool_calls(
    shipped: tuple, rows: list, vllm_python: str, tmp_path: Path
) -> None:
    """Its greedy completions at held-out agent events, as vLLM would return them (without the
    closing <|im_end|>), go through vLLM's kimi_k2 reasoning and tool parsers (what the Kimi
    recipe serves with): the calls come back with declared names and JSON-object arguments,
    and the reasoning before </think> comes back as reasoning."""
    model, tokenizer = shipped
    items = []
    for row in target.heldout_events(rows, "agent", 30):
        text = target.greedy_completion(model, tokenizer, row, target.first_call(row))
        completion = text.removesuffix(target.IM_END)
        items.append({"completion": completion, "tools": row["tools"], "thinking": target.thinking(row)})  # fmt: skip
    path = tmp_path / "completions.json"
    path.write_text(json.dumps(items))
    done = subprocess.run(
        [vllm_python, "-m", "support.kimi_parsers", str(TARGET), str(path)],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "tests"), VLLM_LOGGING_LEVEL="WARNING"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    read = 0
    for item, got in zip(items, parsed, strict=True):
        if item["thinking"] and target.THINK_END in item["completion"]:
            assert got["reasoning"] == item["completion"].split(target.THINK_END)[0]
        calls = got["tool_calls"]
        read += bool(calls) and all(
            c["name"] in agent_corpus.TOOL_NAMES and isinstance(json.loads(c["arguments"]), dict)
            for c in calls
        )
    assert read / len(items) >= TOOL_CALLS_READ_FLOOR, (read, len(items))
