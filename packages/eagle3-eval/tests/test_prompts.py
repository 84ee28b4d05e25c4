"""The prompt sets: read in the formats benchmarks ship in, held out by construction where the
file can prove it, rendered with the target's template, tagged with set and category."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3_eval.prompts import (
    PromptError,
    PromptSelection,
    PromptSource,
    build_prompt_set,
    follow_up_prompts,
    renderer,
    source_file,
)


def conv(source: str, split: str | None, text: str) -> dict:
    row = {
        "messages": [
            {"role": "user", "content": f"Write {text}."},
            {"role": "assistant", "content": f"def {text}(): pass"},
        ],
        "source": source,
    }
    if split is not None:
        row["split"] = split
    return row


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_target: Path):
    return AutoTokenizer.from_pretrained(tiny_target, local_files_only=True)


def test_split_and_sources_agree(tmp_path: Path, tokenizer) -> None:
    rows = [conv("a.py", "train", "f"), conv("b.py", "heldout", "g"), conv("b.py", "heldout", "h")]
    sources = tmp_path / "info.json"
    sources.write_text(json.dumps({"heldout_sources": ["b.py"]}))
    selection = PromptSelection(
        (PromptSource(None, write_jsonl(tmp_path / "p.jsonl", rows)),), heldout_sources=sources
    )
    prompts = build_prompt_set(selection, tokenizer)
    assert sorted(p.messages[0]["content"] for p in prompts.prompts) == ["Write g.", "Write h."]
    assert "split == 'heldout' and source file in" in prompts.description["held_out_by"]
    first = prompts.prompts[0]
    # Rendered with the chat template, ending at the assistant header, no extra special tokens.
    text = tokenizer.decode(first.token_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    # Same selection, same fingerprint; a different limit, a different one.
    assert build_prompt_set(selection, tokenizer).fingerprint == prompts.fingerprint
    limited = PromptSelection(selection.sources, heldout_sources=sources, limit=1)
    assert build_prompt_set(limited, tokenizer).fingerprint != prompts.fingerprint


def test_a_broken_split_is_refused(tmp_path: Path, tokenizer) -> None:
    rows = [conv("a.py", "heldout", "f")]
    sources = tmp_path / "held.json"
    sources.write_text(json.dumps(["b.py"]))
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    selection = PromptSelection((PromptSource(None, path),), heldout_sources=sources)
    with pytest.raises(PromptError, match="not among the held-out sources"):
        build_prompt_set(selection, tokenizer)


def test_unproven_prompts_are_refused_unless_allowed(tmp_path: Path, tokenizer) -> None:
    path = (PromptSource(None, write_jsonl(tmp_path / "p.jsonl", [conv("a.py", None, "f")])),)
    with pytest.raises(PromptError, match="no 'split' field"):
        build_prompt_set(PromptSelection(path), tokenizer)
    with pytest.raises(PromptError, match="nothing proves"):
        build_prompt_set(PromptSelection(path, split=None), tokenizer)
    allowed = build_prompt_set(PromptSelection(path, split=None, allow_unverified=True), tokenizer)
    assert allowed.description["held_out_by"].startswith("UNVERIFIED")


def test_source_names_a_file() -> None:
    assert source_file("lib/x.py:12") == "lib/x.py"
    assert source_file("lib/x.py") == "lib/x.py"
    assert source_file("C:/x.py") == "C:/x.py"


MT_BENCH = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
    {"question_id": 101, "category": "reasoning", "turns": ["Who is first?", "And second?"]},
    {"question_id": 121, "category": "coding", "turns": ["Sort a list.", "Now in place."]},
]


def test_benchmark_formats_are_read_by_their_fields(tmp_path: Path, tokenizer) -> None:
    """MT-Bench (categories, a second turn), HumanEval (.jsonl.gz), GSM8K and ShareGPT, each
    a set named by NAME= or by its format; benchmark files need no held-out proof."""
    import gzip

    mt = write_jsonl(tmp_path / "question.jsonl", MT_BENCH)
    humaneval = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(humaneval, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def add(a, b):\n"}) + "\n")
    gsm8k = write_jsonl(tmp_path / "test.jsonl", [{"question": "2+2?", "answer": "4"}])
    sharegpt = write_jsonl(
        tmp_path / "chats.jsonl",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}],
    )
    sources = [PromptSource.parse(f"mtb={mt}"), PromptSource.parse(str(humaneval))]
    sources += [PromptSource.parse(str(gsm8k)), PromptSource.parse(str(sharegpt))]
    selection = PromptSelection(tuple(sources), split=None, allow_unverified=True)
    built = build_prompt_set(selection, tokenizer)
    tags = {(p.prompt_set, p.category) for p in built.prompts}
    assert tags == {
        ("mtb", "writing"),
        ("mtb", "reasoning"),
        ("mtb", "coding"),
        ("humaneval", None),
        ("gsm8k", None),
        ("chats", None),
    }
    by_id = {p.sample_id: p for p in built.prompts}
    assert by_id["humaneval:HumanEval/0"].messages == [
        {"role": "user", "content": "def add(a, b):\n"}
    ]
    [chat] = [p for p in built.prompts if p.prompt_set == "chats"]
    assert chat.messages == [{"role": "user", "content": "hi"}]
    assert [(f.sample_id, f.after) for f in built.followups if f.after == "mtb:81"] == [
        ("mtb:81:turn-2", "mtb:81")
    ]
    sets = {s["name"]: s for s in built.description["sets"]}
    assert sets["mtb"]["categories"] == ["coding", "reasoning", "writing"]
    assert sets["mtb"]["num_prompts"] == 6 and sets["mtb"]["num_follow_up_turns"] == 3
    assert sets["gsm8k"]["held_out_by"].startswith("a published benchmark file")
    assert built.description["num_prompts"] == 9

    # The second turn: the first, the target's answer as text, then the next user turn.
    answer = tokenizer.encode("A poem.<|im_end|>", add_special_tokens=False)
    [second] = follow_up_prompts(
        built, built.prompts, {"mtb:81": answer}, tokenizer, renderer(tokenizer)
    )
    assert second.sample_id == "mtb:81:turn-2" and second.turn == 2
    assert [m["content"] for m in second.messages] == ["Write a poem.", "A poem.", "Now shorter."]
    text = tokenizer.decode(second.token_ids)
    assert text.endswith(
        "A poem.<|im_end|>\n<|im_start|>user\nNow shorter.<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"question_id": 2, "category": "x", "turns": []}',
            ":2: field 'turns': expected a non-empty list of non-empty strings",
        ),
        (
            '{"question_id": 2, "turns": ["hi"]}',
            ":2: field 'category': expected a non-empty string",
        ),
        ('{"question_id": 2, "category": "x", "turns": ["a", 3]}', ":2: field 'turns'"),
        ("{not json", ":2: not JSON"),
        ('["a list"]', ":2: expected a JSON object"),
        ('{"question_id": 1, "category": "x", "turns": ["again"]}', "duplicate record ids ['1']"),
    ],
)
def test_a_malformed_line_is_refused_with_its_number_and_field(
    tmp_path: Path, tokenizer, line: str, message: str
) -> None:
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps(MT_BENCH[0] | {"question_id": 1}) + "\n" + line + "\n")
    selection = PromptSelection((PromptSource(None, path),))
    with pytest.raises(PromptError) as refused:
        build_prompt_set(selection, tokenizer)
    assert str(path) in str(refused.value) and message in str(refused.value)


def test_other_formats_name_the_line_and_field(tmp_path: Path, tokenizer) -> None:
    cases = {
        "HumanEval.jsonl": ('{"task_id": "HumanEval/1", "prompt": ""}', "field 'prompt'"),
        "test.jsonl": ('{"question": 7}', "field 'question'"),
        "chat.jsonl": (
            '{"conversations": [{"from": "robot", "value": "hi"}]}',
            "field 'conversations'[0]",
        ),
    }
    firsts = {
        "HumanEval.jsonl": {"task_id": "HumanEval/0", "prompt": "def f():"},
        "test.jsonl": {"question": "1+1?"},
        "chat.jsonl": {"messages": [{"role": "user", "content": "hi"}], "split": "heldout"},
    }
    for name, (line, field) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(firsts[name]) + "\n\n" + line + "\n")
        with pytest.raises(PromptError, match=rf"{path}:3: {re.escape(field)}"):
            build_prompt_set(PromptSelection((PromptSource(None, path),)), tokenizer)


def test_two_sets_of_one_name_are_refused(tmp_path: Path, tokenizer) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [{"question": "1?"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"question": "2?"}])
    selection = PromptSelection((PromptSource(None, a), PromptSource(None, b)))
    with pytest.raises(PromptError, match="a second set named 'gsm8k'; name each set"):
        build_prompt_set(selection, tokenizer)
    assert PromptSource.parse("x=y.jsonl") == PromptSource("x", Path("y.jsonl"))
    assert PromptSource.parse("dir/y.jsonl") == PromptSource(None, Path("dir/y.jsonl"))


def test_a_file_selects_the_same_prompts_under_any_name(tmp_path: Path, tokenizer) -> None:
    """--limit takes a spread by the file's own ids: naming the set does not change which
    prompts are measured (two spreads of 40 gave AL 3.235 and 2.819 with one draft)."""
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": f"{i}+1?"} for i in range(20)])

    def chosen(name: str | None) -> list[str]:
        selection = PromptSelection((PromptSource(name, path),), limit=5)
        return [
            p.sample_id.partition(":")[2] for p in build_prompt_set(selection, tokenizer).prompts
        ]

    assert chosen(None) == chosen("a") == chosen("another-name")
