"""ingest: raw chat data in any common layout → the conversations artifact.

Reads ShareGPT (``conversations`` of ``from``/``value``, JSON array or JSONL), OpenAI
``messages`` JSONL, Parquet with either column, and ``datasets`` directories saved with
``save_to_disk``. Agent data too: OpenAI records with ``tools``, assistant ``tool_calls``,
``reasoning_content`` and ``tool`` turns; ShareGPT records whose ``function_call`` (or
``function``) turns hold the calls as JSON ``{name, arguments}`` (or a list of them) and whose
``observation`` (or ``tool``) turns hold the results, answered in call order (ShareGPT has no
call ids: the calls are numbered ``call_0``, ``call_1``, ... through the conversation).
Everything streams (``raw_records`` reads the files): JSONL line by line, JSON arrays object by
object, Parquet by row group, so memory stays bounded by one batch plus the set of seen ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle3_data.config import IngestConfig
from eagle3_data.raw_records import records
from eagle3_data.rejects import RejectsFile
from eagle3_schemas.contract.header import make_header, parquet_stream
from eagle3_schemas.contract.lineage import fingerprint_file, fingerprint_files, fingerprint_json
from eagle3_schemas.layouts.conversations import (
    NO_TOOLS,
    SCHEMA,
    conversation_id,
    conversation_problem,
    tools_problem,
)

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
    "tool": "tool",
}
SHAREGPT_CALLS = ("function_call", "function")
SHAREGPT_RESULTS = ("observation", "tool")


@dataclass
class IngestSummary:
    read: int = 0
    written: int = 0
    skipped: int = 0  # not selected by --keep
    duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)


def run(config: IngestConfig) -> IngestSummary:
    config.check()
    summary = IngestSummary()
    seen: set[str] = set()
    batch: dict[str, list[Any]] = {k: [] for k in SCHEMA.names}
    # the output is published last, after the rejects file: a fault at the rejects leaves no
    # output, so the same command reruns
    with parquet_stream(config.output, SCHEMA) as out, RejectsFile(config.rejects) as rejects:
        for record in records(config.inputs):
            summary.read += 1
            if record.error is not None:
                rejects.add(record.source, record.error, record.raw)
                continue
            if config.keep and not _selected(record.value, config.keep):
                summary.skipped += 1
                continue
            normalised = normalise(record.value)
            if isinstance(normalised, str):
                rejects.add(record.source, normalised, record.value)
                continue
            messages, tools, mode = normalised
            problem = conversation_problem(messages) or tools_problem(tools)
            if problem is not None:
                rejects.add(record.source, problem, record.value)
                continue
            sample_id = conversation_id(messages, tools, mode)
            if sample_id in seen:
                summary.duplicates += 1
                continue
            seen.add(sample_id)
            for key, value in (
                ("id", sample_id),
                ("messages", messages),
                ("source", record.source),
                ("tools", tools),
                ("mode", mode),
            ):
                batch[key].append(value)
            if len(batch["id"]) >= config.batch_rows:
                out.write(pa.table(batch, schema=SCHEMA))
                batch = {k: [] for k in batch}
        if batch["id"]:
            out.write(pa.table(batch, schema=SCHEMA))
        summary.written = out.num_rows
        summary.rejected = dict(rejects.reasons)
        lineage = {"source_fingerprint": source_fingerprint(config.inputs), "generator": "original"}
        out.header = make_header(
            "conversations",
            lineage,
            num_rows=out.num_rows,
            num_rejected=rejects.count,
            inputs=[str(p) for p in config.inputs],
            duplicates=summary.duplicates,
            skipped=summary.skipped,
            keep={k: list(v) for k, v in config.keep.items()},
        )
    return summary


def _selected(record: Any, keep: dict[str, tuple[str, ...]]) -> bool:
    return isinstance(record, dict) and all(str(record.get(k)) in v for k, v in keep.items())


def source_fingerprint(inputs: list[Path]) -> str:
    parts = []
    for path in inputs:
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        parts.append(
            [path.name, fingerprint_files(files, path) if path.is_dir() else fingerprint_file(path)]
        )
    return fingerprint_json(parts)


# ---- normalisation -----------------------------------------------------------------------


def normalise(record: Any) -> tuple[list[dict[str, Any]], str, str] | str:
    """(turns in the project's roles, the declared tools as JSON text, the mode), or the reason
    the record cannot be read. The mode is 'thinking' when a turn carries reasoning_content."""
    if not isinstance(record, dict):
        return f"unknown_format: expected a JSON object per record, found {type(record).__name__}"
    turns = record.get("messages")
    if turns is None:
        turns = record.get("conversations")
    if not isinstance(turns, list):
        return "unknown_format: expected a 'messages' (OpenAI) or 'conversations' (ShareGPT) list"
    tools = _tools(record.get("tools"))
    messages: list[dict[str, Any]] = []
    pending: list[str] = []  # ShareGPT calls not yet answered, in call order
    calls_made = 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"unknown_format: turn {i} is a {type(turn).__name__}, expected an object"
        role = turn.get("role", turn.get("from"))
        key = str(role).lower() if isinstance(role, str) else None
        content = turn.get("content", turn.get("value"))
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            texts = [
                p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"
            ]
            if not all(isinstance(t, str | None) for t in texts):
                return f"unknown_format: turn {i}: field content: a text part's 'text' is not text"
            content = "".join(t or "" for t in texts)
        if "from" in turn and key in SHAREGPT_CALLS:
            calls = _sharegpt_calls(i, content, calls_made)
            if isinstance(calls, str):
                return calls
            calls_made += len(calls)
            pending += [c["id"] for c in calls]
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and "tool_calls" not in last:
                last["tool_calls"] = calls  # the text an assistant said before its call
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": calls})
            continue
        if "from" in turn and key in SHAREGPT_RESULTS:
            if not pending:
                return f"unmatched_tool_result: turn {i} ({key}): no call is waiting for a result"
            call_id = pending.pop(0)
            name = next(
                c["function"]["name"]
                for m in messages
                for c in m.get("tool_calls", ())
                if c["id"] == call_id
            )
            messages.append(
                {"role": "tool", "content": _text(content), "tool_call_id": call_id, "name": name}
            )
            continue
        normalised = ROLE_ALIASES.get(key) if key is not None else None
        if normalised is None:
            known = sorted({*ROLE_ALIASES, *SHAREGPT_CALLS, *SHAREGPT_RESULTS})
            return f"unknown_role: turn {i}: role {role!r} (known: {', '.join(known)})"
        if content is not None and not isinstance(content, str):
            return f"unknown_format: turn {i}: content is a {type(content).__name__}, expected text"
        message: dict[str, Any] = {"role": normalised, "content": content or ""}
        extra = _openai_extras(i, normalised, turn)
        if isinstance(extra, str):
            return extra
        message.update(extra)
        messages.append(message)
    if isinstance(tools, tuple):
        return tools[0]
    thinking = any(m.get("reasoning_content") for m in messages)
    return messages, tools, "thinking" if thinking else "instant"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "" if content is None else json.dumps(content, ensure_ascii=False)


def _tools(tools: Any) -> str | tuple[str]:
    """The declared tools as JSON text in the source's key order ('[]' when none), or (reason,).

    Not sorted: a template renders the tools key by key, and vLLM keeps a request's order inside
    ``parameters`` (``served_tools`` gives the rest vLLM's order at render time); the content id
    hashes canonical JSON anyway."""
    if tools is None or tools == "" or tools == []:
        return NO_TOOLS
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            return (f"bad_tools: field tools: not JSON ({e.msg} at column {e.colno})",)
    if isinstance(tools, list):  # ShareGPT's bare {name, description, parameters}
        tools = [
            {"type": "function", "function": t}
            if isinstance(t, dict) and "function" not in t and "name" in t
            else t
            for t in tools
        ]
    text = json.dumps(tools, ensure_ascii=False)
    problem = tools_problem(text)
    return (problem.replace("bad_tools: tools", "bad_tools: field tools", 1),) if problem else text


def _arguments(where: str, arguments: Any) -> str | tuple[str]:
    """Arguments as JSON text (an object is serialised), or (reason,) naming ``where``."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except json.JSONDecodeError as e:
            return (f"bad_tool_call: {where}.arguments: not JSON ({e.msg} at column {e.colno})",)
        return arguments
    if isinstance(arguments, dict | list):
        return json.dumps(arguments, ensure_ascii=False)
    return (f"bad_tool_call: {where}.arguments: expected JSON text or an object",)


def _openai_extras(i: int, role: str, turn: dict[str, Any]) -> dict[str, Any] | str:
    extra: dict[str, Any] = {}
    if role == "assistant":
        reasoning = turn.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"bad_reasoning: turn {i}: field reasoning_content: expected text"
        if reasoning:
            extra["reasoning_content"] = reasoning
        raw_calls = turn.get("tool_calls")
        if raw_calls:
            if not isinstance(raw_calls, list):
                return f"bad_tool_call: turn {i}: field tool_calls: expected a list"
            calls = []
            for k, call in enumerate(raw_calls):
                where = f"turn {i}: field tool_calls[{k}]"
                if not isinstance(call, dict):
                    return f"bad_tool_call: {where}: expected an object"
                if not isinstance(call.get("id"), str) or not call["id"]:
                    return f"bad_tool_call: {where}.id: a tool call needs an id"
                function = call.get("function")
                if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                    return f"bad_tool_call: {where}.function.name: expected the function's name"
                arguments = _arguments(f"{where}.function", function.get("arguments", "{}"))
                if isinstance(arguments, tuple):
                    return arguments[0]
                calls.append(
                    {
                        "id": call["id"],
                        "type": call.get("type") or "function",
                        "function": {"name": function["name"], "arguments": arguments},
                    }
                )
            extra["tool_calls"] = calls
    if role == "tool":
        call_id = turn.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            return f"unmatched_tool_result: turn {i}: field tool_call_id: a tool result needs the id of its call"
        extra["tool_call_id"] = call_id
        if isinstance(turn.get("name"), str):
            extra["name"] = turn["name"]
    return extra


def _sharegpt_calls(i: int, value: Any, numbered: int) -> list[dict[str, Any]] | str:
    """The calls of a ShareGPT function_call turn: JSON {name, arguments} or a list of them."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as e:
        return f"bad_tool_call: turn {i}: field value: not JSON ({e.msg} at column {e.colno}); expected {{name, arguments}}"
    items = parsed if isinstance(parsed, list) else [parsed]
    calls = []
    for k, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return f"bad_tool_call: turn {i}: field value[{k}]: expected {{name, arguments}}"
        arguments = _arguments(f"turn {i}: field value[{k}]", item.get("arguments", {}))
        if isinstance(arguments, tuple):
            return arguments[0]
        calls.append(
            {
                "id": f"call_{numbered + k}",
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
        )
    return calls
