"""Kinds of traffic (instant, thinking, agent): each prompt classified from its row, rendered
with its tools and mode as the Kimi stand-in's template renders them (K2.5's structure, on the
tiny target's tokenizer), malformed agent rows refused naming file, line and field, and the
report and the several-drafts table giving acceptance per kind."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3_eval.acceptance import SampleCounts, summarize
from eagle3_eval.groups import timed_per_sample
from eagle3_eval.prompts import PromptError, PromptSelection, PromptSource, build_prompt_set
from eagle3_eval.report import Baseline, EvalResult, format_table, read_report, write_report
from eagle3_eval.table import build_table, markdown
from eagle3_schemas.contract.validate import validate

from support.chat_tools import KIMI_AGENT_LOOP, KIMI_SERVED_TOOLS, KIMI_TEMPLATE, KIMI_TOOLS
from support.fixtures import fake_fingerprint

AGENT = [
    *KIMI_AGENT_LOOP,
    {"role": "assistant", "content": "12 C.", "reasoning_content": "read"},
]
GENERATION = "<|im_assistant|>assistant<|im_middle|>"


def chat(text: str, **fields) -> dict:
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return {"messages": messages, "split": "heldout", "source": "s.py", **fields}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def build(path: Path, tokenizer, **kwargs):
    return build_prompt_set(PromptSelection((PromptSource(None, path),)), tokenizer, kwargs)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_target: Path):
    return AutoTokenizer.from_pretrained(tiny_target, local_files_only=True)


@pytest.fixture(scope="module")
def kimi(tiny_tokenizer):
    """The tiny tokenizer with the Kimi stand-in's template: Kimi's format, fast to load."""
    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = KIMI_TEMPLATE.read_text(encoding="utf-8")
    return tokenizer


def as_served(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def test_one_file_holds_all_three_kinds_each_rendered_as_the_template_does(
    tmp_path: Path, kimi
) -> None:
    rows = [
        chat("Add?", mode="instant", id="i"),
        chat("Mul?", mode="thinking", id="t"),
        {"id": "a", "messages": AGENT, "tools": KIMI_TOOLS, "mode": "thinking", "split": "heldout"},
        # tools as eagle3-data's Parquet holds them (JSON text), in instant mode
        {"id": "b", "messages": AGENT, "tools": json.dumps(KIMI_TOOLS), "mode": "instant"}
        | {"split": "heldout"},
    ]
    built = build(write_jsonl(tmp_path / "p.jsonl", rows), kimi)
    by = {p.sample_id.split(":")[1]: p for p in built.prompts}
    assert {k: p.kind for k, p in by.items()} == {
        "i": "instant",
        "t": "thinking",
        "a": "agent",
        "b": "agent",
    }
    assert built.description["sets"][0]["kinds"] == {"instant": 1, "thinking": 1, "agent": 2}
    user = [{"role": "user", "content": "Add?"}]
    gen = {"add_generation_prompt": True}
    assert by["i"].token_ids == as_served(kimi, user, thinking=False, **gen)
    assert by["t"].token_ids == as_served(kimi, [{"role": "user", "content": "Mul?"}], **gen)
    assert by["a"].token_ids == as_served(kimi, AGENT[:3], tools=KIMI_SERVED_TOOLS, **gen)
    assert by["b"].token_ids == as_served(
        kimi, AGENT[:3], tools=KIMI_SERVED_TOOLS, thinking=False, **gen
    )
    text = {k: kimi.decode(p.token_ids) for k, p in by.items()}
    # thinking vs instant as the template defines them: an open think block or an empty one
    assert text["i"].endswith(GENERATION + "<think></think>")
    assert text["t"].endswith(GENERATION + "<think>")
    # agent: the tools are declared, the prompt ends after the tool result; in thinking mode the
    # loop's reasoning stays before its call, in instant mode it goes
    declare = (
        "<|im_system|>tool_declare<|im_middle|>" + json.dumps(KIMI_SERVED_TOOLS) + "<|im_end|>"
    )
    result = "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n12 C<|im_end|>"
    assert text["a"].startswith(declare) and text["b"].startswith(declare)
    assert text["a"].endswith(result + GENERATION + "<think>")
    assert "<think>Look it up.</think>" in text["a"] and "Look it up." not in text["b"]
    assert text["b"].endswith(result + GENERATION + "<think></think>")


def test_a_row_without_mode_takes_the_templates_default(tmp_path: Path, kimi, tiny_tokenizer):
    """No 'mode': the run's kwargs decide (Kimi's template thinks by default); a template
    without modes is instant; rendering is as before kinds existed (the run's kwargs alone)."""
    path = write_jsonl(tmp_path / "p.jsonl", [chat("Hi?")])
    user = [{"role": "user", "content": "Hi?"}]
    thinking = build(path, kimi)
    assert [p.kind for p in thinking.prompts] == ["thinking"]
    assert thinking.description["default_mode"] == "thinking"
    instant = build(path, kimi, thinking=False)
    assert [p.kind for p in instant.prompts] == ["instant"]
    assert instant.prompts[0].token_ids == as_served(
        kimi, user, add_generation_prompt=True, thinking=False
    )
    plain = build(path, tiny_tokenizer)
    assert [p.kind for p in plain.prompts] == ["instant"]
    assert plain.prompts[0].token_ids == as_served(tiny_tokenizer, user, add_generation_prompt=True)


def test_a_row_the_template_cannot_classify_is_refused(tmp_path: Path, tiny_tokenizer) -> None:
    tokenizer = copy.deepcopy(tiny_tokenizer)
    # without a mode this template renders a third prompt, neither its thinking nor its instant
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if thinking is not defined %}?{% elif thinking %}T{% else %}I{% endif %}"
    )
    path = write_jsonl(tmp_path / "p.jsonl", [chat("Hi?", mode="thinking"), chat("Yo?")])
    with pytest.raises(PromptError, match=r"p\.jsonl:2: field 'mode': the row states no mode"):
        build(path, tokenizer)
    stated = write_jsonl(tmp_path / "q.jsonl", [chat("Hi?", mode="thinking")])
    assert [p.kind for p in build(stated, tokenizer).prompts] == ["thinking"]


def _agent_row(**change) -> dict:
    row = {"messages": copy.deepcopy(AGENT), "tools": KIMI_TOOLS, "split": "heldout"}
    return row | change


def _no_call_id() -> dict:
    row = _agent_row()
    del row["messages"][1]["tool_calls"][0]["id"]
    return row


def _arguments_not_json() -> dict:
    row = _agent_row()
    row["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    return row


def _result_for_no_call() -> dict:
    row = _agent_row()
    row["messages"][2]["tool_call_id"] = "functions.other:7"
    return row


def _undeclared_tool() -> dict:
    row = _agent_row()
    row["messages"][1]["tool_calls"][0]["function"]["name"] = "rm_rf"
    row["messages"][2]["name"] = "rm_rf"
    return row


@pytest.mark.parametrize(
    ("row", "field", "why"),
    [
        (_no_call_id(), "messages", r"bad_tool_call: message 1: tool_calls\[0\]\.id"),
        (_arguments_not_json(), "messages", r"tool_calls\[0\]\.function\.arguments: not JSON"),
        (_result_for_no_call(), "messages", r"unmatched_tool_result: message 2"),
        (_undeclared_tool(), "messages", r"'rm_rf' is not among the declared tools"),
        (_agent_row(tools=None), "messages", r"calls a tool but the row declares no 'tools'"),
        (_agent_row(tools="[{"), "tools", r"bad_tools: tools: not JSON"),
        (_agent_row(tools=[{"name": "x"}]), "tools", r"bad_tools: tools\[0\]"),
        (_agent_row(mode="deep"), "mode", r"expected one of \('thinking', 'instant'\)"),
    ],
    ids=[
        "call without id",
        "arguments not JSON",
        "result for no call",
        "undeclared tool",
        "tools missing",
        "tools not JSON",
        "tool without function",
        "unknown mode",
    ],
)
def test_a_malformed_agent_row_is_refused_naming_file_line_and_field(
    tmp_path: Path, kimi, row: dict, field: str, why: str
) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [chat("Fine.", mode="instant"), row])
    with pytest.raises(PromptError, match=rf"p\.jsonl:2: field '{field}': .*{why}"):
        build(path, kimi)


# ---- the report and the table ----------------------------------------------------------------

LINEAGE = {
    "draft_fingerprint": fake_fingerprint("draft"),
    "target_fingerprint": fake_fingerprint("target"),
    "prompts_fingerprint": fake_fingerprint("prompts"),
}


def result(accepted: list[list[int]], tags: list[tuple[str, str | None, str]]) -> EvalResult:
    """Sample i accepts ``accepted[i]`` per step, is tagged (set, category, kind) ``tags[i]``
    and takes 1 s (2 s without the draft for agent prompts, 1.5 s for the others)."""
    samples = []
    for i, (per_step, (prompt_set, category, kind)) in enumerate(zip(accepted, tags, strict=True)):
        counts = SampleCounts(f"p{i}", 3, num_generated_tokens=sum(per_step) + len(per_step))
        for a in per_step:
            counts.observe(3, a)
        counts.seconds = 1.0
        counts.output_token_ids = list(range(counts.num_generated_tokens))
        counts.extra.update(prompt_set=prompt_set, category=category, kind=kind, source="s.py")
        samples.append(counts)
    base = {s.sample_id: 2.0 if s.extra["kind"] == "agent" else 1.5 for s in samples}
    alone = [
        SampleCounts(s.sample_id, 3, seconds=base[s.sample_id], extra=s.extra) for s in samples
    ]
    baseline = Baseline(
        tokens_per_second=20.0,
        per_sample={
            s.sample_id: (s.num_generated_tokens, base[s.sample_id], None) for s in samples
        },
        group_seconds=timed_per_sample(alone),
    )
    return EvalResult(
        mode="vllm",
        summary=summarize(samples, 3),
        samples=samples,
        temperature=0.0,
        engine={"name": "vllm", "versions": {"vllm": "x"}},
        lineage=LINEAGE,
        tokens_per_second=30.0,
        baseline=baseline,
        group_seconds=timed_per_sample(samples),
        extra={"prompts": {"held_out_by": "split == 'heldout'"}},
    )


ACCEPTED = [[3, 3], [0, 0, 0, 0], [1], [2, 2, 2]]
TAGS = [
    ("mt", "coding", "instant"),
    ("kimi", None, "thinking"),
    ("kimi", None, "agent"),
    ("kimi", None, "agent"),
]


def test_the_report_gives_acceptance_per_kind_beside_sets_and_categories(tmp_path: Path) -> None:
    out = write_report(result(ACCEPTED, TAGS), tmp_path / "report")
    assert validate(out) == []
    report = read_report(out)
    kinds = {k["kind"]: k for k in report.kinds}
    assert list(kinds) == ["instant", "thinking", "agent"]  # KINDS order, not file order
    assert kinds["instant"]["acceptance_length"] == pytest.approx(1 + 6 / 2)
    assert kinds["thinking"]["acceptance_length"] == 1.0
    # pooled, vLLM's way: 1 + (1 + 6) accepted / (1 + 3) drafts, not a mean of the two prompts
    assert kinds["agent"]["acceptance_length"] == pytest.approx(1 + 7 / 4)
    assert kinds["agent"]["per_position_acceptance"] == pytest.approx([1, 0.75, 0])
    assert (kinds["agent"]["num_prompts"], kinds["agent"]["num_drafts"]) == (2, 4)
    assert (
        sum(k["num_accepted_tokens"] for k in kinds.values())
        == report.fields["num_accepted_tokens"]
    )
    # each kind timed on its own: 2 s per agent prompt without the draft, 1.5 s for the others
    assert kinds["agent"]["speedup"] == pytest.approx(2.0)
    assert kinds["instant"]["speedup"] == pytest.approx(1.5)
    # the per-set and per-category rows are still there, unchanged by kinds
    groups = {(g["prompt_set"], g["category"]) for g in report.groups}
    assert groups == {("mt", None), ("mt", "coding"), ("kimi", None)}
    assert report.samples.column("kind").to_pylist() == [t[2] for t in TAGS]
    table = format_table(report)
    assert "  per kind of traffic  prompts  drafts  AL" in table
    assert "    agent                    2       4  2.750   1.00 0.75 0.00       2.00" in table


def test_the_several_drafts_table_has_a_column_per_kind(tmp_path: Path) -> None:
    a = read_report(write_report(result(ACCEPTED, TAGS), tmp_path / "a"))
    b = read_report(write_report(result([[0], [0], [0], [1]], TAGS), tmp_path / "b"))
    table = build_table({"a": [a], "b": [b]})
    assert table["columns"] == [
        "all",
        "mt",
        "mt/coding",
        "kimi",
        "kind:instant",
        "kind:thinking",
        "kind:agent",
    ]
    cells = {row["draft"]: row["cells"] for row in table["rows"]}
    for name, report in (("a", a), ("b", b)):
        for kind in report.kinds:
            assert (
                cells[name][f"kind:{kind['kind']}"]["acceptance_length"]
                == (kind["acceptance_length"])
            )
    assert cells["b"]["kind:agent"]["acceptance_length"] == pytest.approx(1 + 1 / 2)
    assert "| kind:instant | kind:thinking | kind:agent |" in markdown(table)


def test_the_agent_corpus_rows_are_classified_as_they_were_made(tmp_path: Path, kimi) -> None:
    """The agent target's corpus states each row's kind and no mode: eval's kind is the row's,
    and its mode is ingest's (thinking where a turn carries reasoning), so an agent answering
    without reasoning (Kimi's instant mode with tools) is rendered instant."""
    from support.agent_corpus import build_agent_corpus

    rows = build_agent_corpus(conversations=60, seed=0)
    built = build_prompt_set(
        PromptSelection(
            (PromptSource(None, write_jsonl(tmp_path / "agent.jsonl", rows)),),
            split=None,
            allow_unverified=True,
        ),
        kimi,
    )
    made = {r["source"]: r for r in rows}
    assert len(built.prompts) == len(rows)
    modes = set()
    for prompt in built.prompts:
        row = made[prompt.source]
        assert prompt.kind == row["kind"]
        thinks = any(m.get("reasoning_content") for m in row["messages"])
        assert prompt.mode == ("thinking" if thinks else "instant")
        ending = "<think>" if thinks else "<think></think>"
        assert kimi.decode(prompt.token_ids).endswith(GENERATION + ending)
        modes.add((prompt.kind, prompt.mode))
    assert {("instant", "instant"), ("thinking", "thinking"), ("agent", "thinking")} <= modes


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"kind": "chat"}, r"expected one of \('instant', 'thinking', 'agent'\)"),
        ({"kind": "instant"}, r"'instant' but the row declares tools"),
        ({"tools": None, "kind": "agent"}, r"'agent' but the row declares no tools"),
    ],
    ids=["unknown kind", "instant with tools", "agent without tools"],
)
def test_a_row_whose_kind_contradicts_it_is_refused(
    tmp_path: Path, kimi, change: dict, why: str
) -> None:
    row = {"messages": AGENT[:1], "tools": KIMI_TOOLS, "split": "heldout"} | change
    path = write_jsonl(tmp_path / "p.jsonl", [chat("Fine.", mode="instant"), row])
    with pytest.raises(PromptError, match=rf"p\.jsonl:2: field 'kind': {why}"):
        build(path, kimi)
    mode = write_jsonl(tmp_path / "m.jsonl", [chat("Hi?", kind="thinking", mode="instant")])
    with pytest.raises(PromptError, match=r"m\.jsonl:1: field 'kind': 'thinking' but the row's"):
        build(mode, kimi)
