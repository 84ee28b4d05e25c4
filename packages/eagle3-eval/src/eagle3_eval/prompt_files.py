"""Prompt files in the formats benchmark sets ship in, read into one shape: ``Item``.

Formats, told apart by the fields of the first record (a file holds one format):

- ``mt-bench``: MT-Bench's ``question.jsonl``: ``question_id``, ``category``, ``turns`` (the
  user's turns; the second is asked after the target's own answer to the first).
- ``humaneval``: OpenAI's ``HumanEval.jsonl(.gz)``: ``task_id``, ``prompt`` (a code stub the
  model completes, sent as the user's message, as SpecForge's benchmark does).
- ``gsm8k``: GSM8K's ``test.jsonl``: ``question`` (``answer`` is not used).
- ``chat``: conversations, ``messages`` (OpenAI roles) or ``conversations`` (ShareGPT's
  ``from``/``value``), as eagle3-data writes them or the tiny corpus holds them; the prompt is
  every message before the last assistant turn. Only these rows carry ``split``/``source``,
  the held-out proof ``prompts.select`` checks. ``messages`` rows may be agent traffic, as
  conversations v2 holds it: the tool role (``tool_call_id``, ``name``), ``tool_calls`` and
  ``reasoning_content`` on assistant turns, the declared ``tools`` (a JSON array, or its JSON
  text as in Parquet), the row's ``mode`` (thinking or instant) and its ``kind`` (``KINDS``);
  such a row is checked by the conversations contract and its prompt may end after a tool
  result. Its mode, where it states none: its kind's (instant, thinking), else ingest's rule
  for conversations v2 traffic (tools declared or a kind stated): thinking where a turn carries
  ``reasoning_content``, else instant; a plain row (no tools, no kind) with reasoning thinks;
  any other row states no mode (the run's default applies, ``prompts.default_mode``).

Files are ``.jsonl``, ``.jsonl.gz`` or ``.parquet``; nothing is downloaded. A malformed record
is refused with the file, its line (or Parquet row) and the field.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_schemas.layouts.conversations import (
    ID_FIELDS,
    MODES,
    NO_TOOLS,
    ROLES_V2,
    conversation_id,
    conversation_problem,
    tools_problem,
)

# Kinds of traffic a prompt belongs to (prompts.classify): agent where tools are declared.
KINDS = ("instant", "thinking", "agent")
# ShareGPT speaker names -> OpenAI roles.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


class PromptFileError(ValueError):
    """A prompt file, or one of its records, cannot be read; the message names where."""


@dataclass(frozen=True)
class Item:
    """One record: the messages of its first prompt and, for multi-turn sets, later user turns."""

    key: str  # unique within its file: question_id, task_id, id or line number
    messages: list[dict[str, Any]]
    later_turns: list[str] = field(default_factory=list)
    category: str | None = None
    row: dict[str, Any] = field(default_factory=dict)  # chat rows: split, source, id
    where: str = ""  # FILE:LINE or FILE row N, for errors about this record
    tools: str = NO_TOOLS  # chat rows: the declared tools, JSON text
    mode: str | None = None  # chat rows: 'thinking' or 'instant', stated or derived (above)


def records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, record) for every record; ``where`` is ``FILE:LINE`` or ``FILE row N``."""
    if not path.is_file():
        raise PromptFileError(f"{path}: no such prompt file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for number, row in enumerate(pq.read_table(path).to_pylist(), 1):
            yield f"{path} row {number}", row
        return
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{where}: not JSON ({e})") from e
            if not isinstance(record, dict):
                raise PromptFileError(f"{where}: expected a JSON object, found {record!r:.60}")
            yield where, record


def detect_format(record: dict[str, Any], where: str) -> str:
    if "turns" in record:
        return "mt-bench"
    if "task_id" in record and "prompt" in record:
        return "humaneval"
    if "question" in record:
        return "gsm8k"
    if "messages" in record or "conversations" in record:
        return "chat"
    raise PromptFileError(
        f"{where}: unknown prompt format (fields {sorted(record)}); expected MT-Bench "
        "(turns, category), HumanEval (task_id, prompt), GSM8K (question) or chat "
        "(messages, or ShareGPT conversations)"
    )


def read_items(path: Path) -> tuple[str, list[Item]]:
    """The file's format and its items, in file order."""
    fmt: str | None = None
    items: list[Item] = []
    for where, record in records(path):
        fmt = fmt or detect_format(record, where)
        items.append(READERS[fmt](record, where, len(items) + 1))
    if fmt is None:
        raise PromptFileError(f"{path}: no records")
    keys = [item.key for item in items]
    if len(set(keys)) != len(keys):
        twice = sorted({k for k in keys if keys.count(k) > 1})[:5]
        raise PromptFileError(f"{path}: duplicate record ids {twice}")
    return fmt, items


def _text(record: dict[str, Any], name: str, where: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value.strip():
        raise PromptFileError(
            f"{where}: field {name!r}: expected a non-empty string, got {value!r:.60}"
        )
    return value


def _key(record: dict[str, Any], name: str, where: str) -> str:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise PromptFileError(
            f"{where}: field {name!r}: expected a string or integer id, got {value!r:.60}"
        )
    return str(value)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def mt_bench(record: dict[str, Any], where: str, number: int) -> Item:
    turns = record.get("turns")
    if (
        not isinstance(turns, list)
        or not turns
        or not all(isinstance(t, str) and t.strip() for t in turns)
    ):
        raise PromptFileError(
            f"{where}: field 'turns': expected a non-empty list of non-empty strings, got {turns!r:.60}"
        )
    return Item(
        _key(record, "question_id", where),
        _user(turns[0]),
        later_turns=list(turns[1:]),
        category=_text(record, "category", where),
        where=where,
    )


def humaneval(record: dict[str, Any], where: str, number: int) -> Item:
    return Item(_key(record, "task_id", where), _user(_text(record, "prompt", where)), where=where)


def gsm8k(record: dict[str, Any], where: str, number: int) -> Item:
    key = _key(record, "id", where) if "id" in record else str(number)
    return Item(key, _user(_text(record, "question", where)), where=where)


def _tools(record: dict[str, Any], where: str) -> str:
    """The row's declared tools as JSON text ('[]' when none): a JSON array, or its text."""
    tools = record.get("tools")
    if tools is None:
        return NO_TOOLS
    text = json.dumps(tools) if isinstance(tools, list) else tools
    problem = tools_problem(text)
    if problem:
        raise PromptFileError(f"{where}: field 'tools': {problem}")
    return str(text) if json.loads(text) else NO_TOOLS


def _mode(record: dict[str, Any], where: str) -> str | None:
    mode = record.get("mode")
    if mode is not None and mode not in MODES:
        raise PromptFileError(f"{where}: field 'mode': expected one of {MODES}, got {mode!r:.60}")
    return mode


def _kind(record: dict[str, Any], where: str, tools: str, mode: str | None) -> str | None:
    """The row's stated kind, checked against its tools and mode."""
    kind = record.get("kind")
    if kind is None:
        return None
    if kind not in KINDS:
        raise PromptFileError(f"{where}: field 'kind': expected one of {KINDS}, got {kind!r:.60}")
    if (kind == "agent") != (tools != NO_TOOLS):
        declared = "declares tools" if tools != NO_TOOLS else "declares no tools"
        raise PromptFileError(
            f"{where}: field 'kind': {kind!r} but the row {declared} (agent rows, and only they, "
            "declare tools)"
        )
    if kind in MODES and mode is not None and mode != kind:
        raise PromptFileError(f"{where}: field 'kind': {kind!r} but the row's mode is {mode!r}")
    return kind


def _derived_mode(kind: str | None, tools: str, messages: list[dict[str, Any]]) -> str | None:
    """A row's mode where it states none (see the module's docstring); None: the run's."""
    if kind in MODES:
        return kind
    if any(m.get("reasoning_content") for m in messages):
        return "thinking"
    return "instant" if kind is not None or tools != NO_TOOLS else None


def _agent_problem(messages: list[dict[str, Any]], tools: str) -> str | None:
    """Why a row's tool turns do not fit its declared tools: conversations v2's rules (a
    prompt-only row may lack an assistant turn), tools declared, calls naming declared ones."""
    problem = conversation_problem(messages)
    if problem and not problem.startswith("no_assistant"):
        return problem
    declared = {t["function"]["name"] for t in json.loads(tools)}
    for i, message in enumerate(messages):
        for k, call in enumerate(message.get("tool_calls") or []):
            if not declared:
                return f"message {i} calls a tool but the row declares no 'tools'"
            if call["function"]["name"] not in declared:
                return (
                    f"message {i}: tool_calls[{k}].function.name {call['function']['name']!r} "
                    f"is not among the declared tools {sorted(declared)}"
                )
        if message["role"] == "tool" and not declared:
            return f"message {i} is a tool result but the row declares no 'tools'"
    return None


def chat(record: dict[str, Any], where: str, number: int) -> Item:
    if "messages" in record:
        messages = record["messages"]
        name, role_key, text_key, roles = "messages", "role", "content", None
    else:
        messages = record.get("conversations")
        name, role_key, text_key, roles = "conversations", "from", "value", SHAREGPT_ROLES
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{where}: field {name!r}: expected a non-empty list of messages")
    allowed = ROLES_V2 if roles is None else ("system", "user", "assistant")
    normalised: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get(role_key) if isinstance(message, dict) else None
        text = message.get(text_key) if isinstance(message, dict) else None
        role = roles.get(str(role).lower()) if roles is not None else role
        if text is None and role == "assistant" and message.get("tool_calls"):
            text = ""  # OpenAI's null content beside tool calls
        if role not in allowed or not isinstance(text, str):
            raise PromptFileError(
                f"{where}: field {name!r}[{i}]: expected {{{role_key!r}: "
                f"{'/'.join(allowed)}, {text_key!r}: text}}, got {message!r:.80}"
            )
        extra = {k: message[k] for k in ID_FIELDS if message.get(k) not in (None, [])}
        normalised.append({"role": str(role), "content": text, **extra})
    tools, mode = _tools(record, where), _mode(record, where)
    kind = _kind(record, where, tools, mode)
    if tools != NO_TOOLS or any(len(m) != 2 for m in normalised):
        problem = _agent_problem(normalised, tools)
        if problem:
            raise PromptFileError(f"{where}: field {name!r}: {problem}")
    last = max((i for i, m in enumerate(normalised) if m["role"] == "assistant"), default=None)
    prompt = normalised if last is None else normalised[:last]
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        raise PromptFileError(
            f"{where}: field {name!r}: the prompt (messages before the last assistant turn) "
            "must end with a user turn or a tool result"
        )
    category = record.get("category")
    # The held-out proof: split and source as the row states them (no split key: none stated).
    row = {key: record[key] for key in ("split", "source") if key in record}
    mode = mode or _derived_mode(kind, tools, normalised)
    return Item(
        str(record.get("id") or conversation_id(normalised, tools, mode or "instant")),
        prompt,
        category=str(category) if category is not None else None,
        row=row,
        where=where,
        tools=tools,
        mode=mode,
    )


READERS = {"mt-bench": mt_bench, "humaneval": humaneval, "gsm8k": gsm8k, "chat": chat}
