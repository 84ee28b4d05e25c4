"""The prompt set: held out by construction, rendered with the target's template, recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle3_eval.prompts import PromptError, PromptSelection, build_prompt_set, source_file


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
    selection = PromptSelection(write_jsonl(tmp_path / "p.jsonl", rows), heldout_sources=sources)
    prompts = build_prompt_set(selection, tokenizer)
    assert sorted(p.messages[0]["content"] for p in prompts.prompts) == ["Write g.", "Write h."]
    assert "split == 'heldout' and source file in" in prompts.description["held_out_by"]
    first = prompts.prompts[0]
    # Rendered with the chat template, ending at the assistant header, no extra special tokens.
    text = tokenizer.decode(first.token_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    # Same selection, same fingerprint; a different limit, a different one.
    assert build_prompt_set(selection, tokenizer).fingerprint == prompts.fingerprint
    limited = PromptSelection(selection.path, heldout_sources=sources, limit=1)
    assert build_prompt_set(limited, tokenizer).fingerprint != prompts.fingerprint


def test_a_broken_split_is_refused(tmp_path: Path, tokenizer) -> None:
    rows = [conv("a.py", "heldout", "f")]
    sources = tmp_path / "held.json"
    sources.write_text(json.dumps(["b.py"]))
    selection = PromptSelection(write_jsonl(tmp_path / "p.jsonl", rows), heldout_sources=sources)
    with pytest.raises(PromptError, match="not among the held-out sources"):
        build_prompt_set(selection, tokenizer)


def test_unproven_prompts_are_refused_unless_allowed(tmp_path: Path, tokenizer) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", [conv("a.py", None, "f")])
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
