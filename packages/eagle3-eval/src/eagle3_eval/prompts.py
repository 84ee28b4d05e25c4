"""The prompt set: held out from training by source, rendered with the target's chat template.

Accepted inputs: a conversations Parquet artifact (eagle3-data) or a JSONL file with one
conversation per line ``{"messages": [...], "source": ..., "split": ..., "id": ...}`` (the
form ``tools/targets/build_tiny_target.py --corpus-only`` writes). A conversation's prompt is every
message before its last assistant turn, rendered with ``add_generation_prompt``.

Held out by construction: a row is used only when its ``split`` equals the requested split
and/or its source file is listed as held out (``--heldout-sources``: a JSON list, or a JSON
object with a ``heldout_sources`` list such as the tiny target's build_info.json). A source
``path:line`` counts by its path. Without either proof the set is refused, unless the caller
says ``allow_unverified`` — and then the report says so.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_schemas.conversations import conversation_id
from eagle3_schemas.lineage import fingerprint_file, fingerprint_json


class PromptError(ValueError):
    """The prompt set cannot be built as asked."""


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    source: str
    messages: list[dict[str, str]]
    token_ids: list[int]


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    description: dict[str, Any]  # goes into the report: file, selection, counts, fingerprint

    @property
    def fingerprint(self) -> str:
        return str(self.description["fingerprint"])


@dataclass(frozen=True)
class PromptSelection:
    path: Path
    split: str | None = "heldout"
    heldout_sources: Path | None = None
    limit: int | None = None
    max_prompt_tokens: int = 1024
    allow_unverified: bool = False


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise PromptError(f"{path}: no such prompt file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{number}: not JSON ({e})") from e
    return rows


def read_heldout_sources(path: Path) -> set[str]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise PromptError(f"{path}: cannot read held-out sources ({e})") from e
    sources = obj.get("heldout_sources") if isinstance(obj, dict) else obj
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise PromptError(
            f"{path}: expected a JSON list of source names or an object with 'heldout_sources'"
        )
    return set(sources)


def source_file(source: str) -> str:
    """'lib/foo.py:12' -> 'lib/foo.py' (a source names a file, optionally a line in it)."""
    head, sep, tail = source.rpartition(":")
    return head if sep and tail.isdigit() else source


def prompt_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages before the last assistant turn (the answer the target will regenerate)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    kept = messages if last is None else messages[:last]
    if not kept or kept[-1].get("role") != "user":
        raise PromptError("a prompt must end with a user turn")
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in kept]


def select(rows: list[dict[str, Any]], selection: PromptSelection) -> tuple[list[dict], str]:
    """Rows held out by construction, and a sentence saying how that was established."""
    heldout = read_heldout_sources(selection.heldout_sources) if selection.heldout_sources else None
    has_split = any("split" in r for r in rows)
    if selection.split is not None and not has_split and heldout is None:
        raise PromptError(
            f"{selection.path}: rows carry no 'split' field; pass --heldout-sources or "
            "--split none with --allow-unverified-prompts"
        )
    kept = []
    for row in rows:
        source = str(row.get("source", ""))
        if selection.split is not None and has_split and row.get("split") != selection.split:
            continue
        if heldout is not None:
            if not source:
                raise PromptError(f"{selection.path}: row {row.get('id')!r} has no 'source'")
            if source_file(source) not in heldout:
                if selection.split is not None and has_split:
                    # Both proofs were given and they disagree: that is a broken split.
                    raise PromptError(
                        f"{selection.path}: row with source {source!r} has split "
                        f"{row.get('split')!r} but its file is not among the held-out sources "
                        f"of {selection.heldout_sources}"
                    )
                continue
        kept.append(row)
    rules = []
    if selection.split is not None and has_split:
        rules.append(f"split == {selection.split!r}")
    if heldout is not None:
        rules.append(f"source file in {selection.heldout_sources} ({len(heldout)} files)")
    if not rules:
        if not selection.allow_unverified:
            raise PromptError(
                f"{selection.path}: nothing proves these prompts are held out from training; "
                "give --heldout-sources or use rows with a 'split' field "
                "(or --allow-unverified-prompts)"
            )
        rules.append("UNVERIFIED: no held-out proof given")
    return kept, " and ".join(rules)


def build_prompt_set(
    selection: PromptSelection, tokenizer: Any, template_kwargs: dict[str, Any] | None = None
) -> PromptSet:
    rows, rule = select(read_rows(selection.path), selection)
    prompts: list[Prompt] = []
    too_long = 0
    for row in rows:
        messages = prompt_messages(row["messages"])
        sample_id = str(row.get("id") or conversation_id(row["messages"]))
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
        # The template writes the special tokens itself; the tokenizer must not add more.
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if len(ids) > selection.max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(Prompt(sample_id, str(row.get("source", "")), messages, ids))
    # A stable spread over the whole held-out set, whatever the file order: by id hash.
    prompts.sort(key=lambda p: hashlib.sha256(p.sample_id.encode()).hexdigest())
    if selection.limit is not None:
        prompts = prompts[: selection.limit]
    if not prompts:
        raise PromptError(f"{selection.path}: no prompts left after selection ({rule})")
    ids = [p.sample_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise PromptError(f"{selection.path}: duplicate sample ids in the prompt set")
    fingerprint = fingerprint_json(
        [{"id": p.sample_id, "prompt_token_ids": p.token_ids} for p in prompts]
    )
    description = {
        "path": str(selection.path),
        "file_fingerprint": fingerprint_file(selection.path),
        "held_out_by": rule,
        "num_rows_selected": len(rows),
        "num_too_long": too_long,
        "max_prompt_tokens": selection.max_prompt_tokens,
        "limit": selection.limit,
        "num_prompts": len(prompts),
        "num_sources": len({source_file(p.source) for p in prompts}),
        # What the engines saw: ids and token ids (chat template and tokenizer included).
        "fingerprint": fingerprint,
    }
    return PromptSet(prompts, description)
