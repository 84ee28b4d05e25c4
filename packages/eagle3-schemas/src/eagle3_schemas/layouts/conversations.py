"""Contract of the conversations artifact shared by its writers and readers: roles, tool calls,
ids, and the seeded selection of samples by id that every stage taking a subset uses.

Version 2 adds the tool role, ``tool_calls`` and ``reasoning_content`` on assistant turns, the
target's token ids per generation event, and per row the declared ``tools`` and the ``mode``.
Version 1 files (role and content only) are still read: ``iter_rows`` returns their turns as
before, and a row with only role and content keeps its version 1 id.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa

from eagle3_schemas.io.fingerprint import canonical_json

ROLES = ("system", "user", "assistant")  # version 1
ROLES_V2 = (*ROLES, "tool")
MODES = ("thinking", "instant")
# The fields of a turn that its content id covers, besides role and content.
ID_FIELDS = ("reasoning_content", "tool_calls", "tool_call_id", "name")
TOKEN_FIELDS = ("prompt_token_ids", "completion_token_ids")

TOOL_CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
MESSAGE_V2 = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("reasoning_content", pa.string()),
        ("tool_calls", pa.list_(TOOL_CALL)),
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("completion_token_ids", pa.list_(pa.int32())),
    ]
)
# The schema file's spelling of the messages column's type.
CONVERSATION_TURNS_V2 = (
    "list<struct<role: string, content: string, reasoning_content: string, "
    "tool_calls: list<struct<id: string, type: string, function: struct<name: string, "
    "arguments: string>>>, tool_call_id: string, name: string, prompt_token_ids: list<int32>, "
    "completion_token_ids: list<int32>>>"
)
SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("messages", pa.list_(MESSAGE_V2)),
        ("source", pa.string()),
        ("tools", pa.string()),
        ("mode", pa.string()),
    ]
)
NO_TOOLS = "[]"


def clean_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A turn as read from Parquet without the fields it does not have (null, or no calls): a
    version 1 turn, or a version 2 turn with role and content only, is exactly {role, content}."""
    return {k: v for k, v in message.items() if v is not None and not (k == "tool_calls" and not v)}


def read_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [clean_message(m) for m in messages]


def iter_rows(path: Any, batch_size: int = 1024) -> Iterator[dict[str, Any]]:
    """Every row of a conversations artifact, version 1 or 2, as {id, source, messages, tools,
    mode}: turns cleaned by ``clean_message``; a version 1 row has no tools and mode 'instant'."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    columns = [c for c in ("id", "source", "messages", "tools", "mode") if c in names]
    for batch in parquet.iter_batches(batch_size=batch_size, columns=columns):
        d = batch.to_pydict()
        for i, sample_id in enumerate(d["id"]):
            yield {
                "id": sample_id,
                "source": d["source"][i],
                "messages": read_messages(d["messages"][i]),
                "tools": d["tools"][i] if "tools" in d else NO_TOOLS,
                "mode": d["mode"][i] if "mode" in d else "instant",
            }


def conversation_id(
    messages: Sequence[Mapping[str, Any]], tools: str = NO_TOOLS, mode: str = "instant"
) -> str:
    """The stable content id, 32 hex digits of a sha256 of canonical JSON.

    A row with only role and content, no tools and mode 'instant' hashes its [{role, content}]
    list, as version 1 did; any other row hashes {messages, tools, mode}, where each turn keeps
    whichever of ``ID_FIELDS`` it has: every field counts except the token ids.
    """
    normalised = [
        {
            "role": m["role"],
            "content": m["content"],
            **{k: m[k] for k in ID_FIELDS if m.get(k) is not None and m.get(k) != []},
        }
        for m in messages
    ]
    plain = all(len(m) == 2 for m in normalised)
    if plain and tools == NO_TOOLS and mode == "instant":
        return hashlib.sha256(canonical_json(normalised)).hexdigest()[:32]
    whole = {"messages": normalised, "tools": json.loads(tools), "mode": mode}
    return hashlib.sha256(canonical_json(whole)).hexdigest()[:32]


def template_kwargs(tools: str, mode: str) -> dict[str, Any]:
    """What the target's chat template is given for a row: its declared tools (JSON text) as
    vLLM serves them (``served_tools``; None when there are none) and its mode, under both
    names templates use for it (Kimi's ``thinking``, Qwen3's ``enable_thinking``)."""
    thinking = mode == "thinking"
    return {"tools": served_tools(tools) or None, "thinking": thinking, "enable_thinking": thinking}


def served_tools(tools: str) -> list[dict[str, Any]]:
    """The declared tools (JSON text that ``tools_problem`` passes) as vLLM's chat endpoint gives
    them to the chat template, which renders them key by key (Kimi's ``tools | tojson``).

    vLLM passes each tool's ``ChatCompletionToolsParam.model_dump()`` (vllm 0.32,
    entrypoints/openai/chat_completion/protocol.py), so its fields come in the model's order,
    whatever the request's: type, function {name, description, parameters, strict,
    defer_loading}, defer_loading. A missing description or parameters is null; strict and
    defer_loading appear only where set (a tool's defer_loading also on its function); other
    keys are dropped. ``parameters`` is a plain dict: it keeps the request's own order.
    """
    served = []
    for tool in json.loads(tools):
        source, defer = tool["function"], tool.get("defer_loading")
        function = {
            "name": source["name"],
            "description": source.get("description"),
            "parameters": source.get("parameters"),
            "strict": source.get("strict"),
            "defer_loading": defer
            if source.get("defer_loading") is None
            else source["defer_loading"],
        }
        for key in ("strict", "defer_loading"):
            if function[key] is None:
                del function[key]
        served.append({"type": "function", "function": function})
        if defer is not None:
            served[-1]["defer_loading"] = defer
    return served


def render_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: str,
    mode: str,
    defaults: Mapping[str, Any] | None = None,
) -> str:
    """A generation event's prompt as served: ``messages`` rendered by the tokenizer's chat
    template with the row's tools and mode (over ``defaults``, other template kwargs) and the
    generation prompt. The data stage tokenizes events from it, eval renders its prompts by it."""
    kwargs = {**(defaults or {}), **template_kwargs(tools, mode)}
    return tokenizer.apply_chat_template(
        served_messages(messages), tokenize=False, add_generation_prompt=True, **kwargs
    )


def served_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The turns of a request as vLLM's chat endpoint gives them to the template: each tool
    call's arguments parsed into an object (a non-object or unreadable one becomes {}), which
    templates render with ``tojson`` (vllm 0.32, renderers/chat_utils._postprocess_messages).
    So a call in a prompt's history reads as ``json.dumps`` writes it, whatever its source's
    spacing or escapes."""
    served = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and calls:
            message = {
                **message,
                "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": _arguments(c["function"])}}
                    for c in calls
                ],
            }
        served.append(dict(message))
    return served


def _arguments(function: Mapping[str, Any]) -> dict[str, Any]:
    arguments = function.get("arguments")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) and arguments else arguments
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def tools_problem(tools: Any) -> str | None:
    """Why ``tools`` (the JSON text of the declared tools) is not a list of named function
    tools, or None."""
    try:
        declared = json.loads(tools) if isinstance(tools, str) else None
    except json.JSONDecodeError as e:
        return f"bad_tools: tools: not JSON ({e.msg} at column {e.colno})"
    if not isinstance(declared, list):
        return "bad_tools: tools: expected a JSON array of tool objects"
    for i, tool in enumerate(declared):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f"bad_tools: tools[{i}]: expected {{type: 'function', function: {{name, ...}}}}"
        if tool.get("type", "function") != "function":
            return f"bad_tools: tools[{i}].type: {tool['type']!r} (vLLM serves only 'function')"
        # What vLLM's ChatCompletionToolsParam refuses (or would coerce), refused here by name.
        for where, value, kind, name in (
            ("function.description", function.get("description"), str, "text"),
            ("function.parameters", function.get("parameters"), dict, "a JSON object"),
            ("function.strict", function.get("strict"), bool, "true or false"),
            ("function.defer_loading", function.get("defer_loading"), bool, "true or false"),
            ("defer_loading", tool.get("defer_loading"), bool, "true or false"),
        ):
            if value is not None and not isinstance(value, kind):
                found = type(value).__name__
                return f"bad_tools: tools[{i}].{where}: expected {name} or null, found {found}"
    return None


def _tool_call_problem(i: int, k: int, call: Any, seen: set[str]) -> str | None:
    where = f"message {i}: tool_calls[{k}]"
    if not isinstance(call, Mapping):
        return f"bad_tool_call: {where}: expected an object, found {type(call).__name__}"
    if not isinstance(call.get("id"), str) or not call["id"]:
        return f"bad_tool_call: {where}.id: a tool call needs a non-empty id"
    if call["id"] in seen:
        return f"bad_tool_call: {where}.id: {call['id']!r} is used by an earlier call"
    if call.get("type", "function") != "function":
        return f"bad_tool_call: {where}.type: {call.get('type')!r} (expected 'function')"
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        return f"bad_tool_call: {where}.function.name: expected the function's name"
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        return f"bad_tool_call: {where}.function.arguments: expected JSON text, found {type(arguments).__name__}"
    try:
        json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"bad_tool_call: {where}.function.arguments: not JSON ({e.msg} at column {e.colno})"
    return None


def conversation_problem(messages: Sequence[Mapping[str, Any]], version: int = 2) -> str | None:
    """Why ``messages`` breaks the role convention of conversations ``version``, or None.

    The message starts with a short class (``unknown_role``, ``empty_turn``,
    ``not_alternating``, ``no_assistant``, ``bad_tool_call``, ``unmatched_tool_result``,
    ``bad_reasoning``) before a colon, for counting rejects by kind.
    """
    if version == 1:
        return _v1_problem(messages)
    if not messages:
        return "empty_turn: no messages"
    roles = [m.get("role") for m in messages]
    pending: dict[str, str] = {}  # calls of the last assistant turn not yet answered
    seen: set[str] = set()
    previous: str | None = None
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES_V2:
            return f"unknown_role: message {i}: role {role!r} (expected system, user, assistant or tool)"
        calls = m.get("tool_calls") or []
        if role != "assistant" and calls:
            return f"bad_tool_call: message {i}: tool_calls on a {role} turn (only assistant turns call tools)"
        if not isinstance(m.get("content"), str) or (not m["content"].strip() and not calls):
            return f"empty_turn: message {i} ({role}) has empty content"
        reasoning = m.get("reasoning_content")
        if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
            return (
                f"bad_reasoning: message {i}: reasoning_content must be text on an assistant turn"
            )
        if role == "system" and i > 0:
            return f"not_alternating: message {i}: a system message is allowed only first"
        if role == "tool":
            call_id = m.get("tool_call_id")
            if call_id not in pending:
                answered = "answers no pending call" if call_id else "has no tool_call_id"
                return (
                    f"unmatched_tool_result: message {i}: tool_call_id {call_id!r} {answered} "
                    f"(pending calls: {sorted(pending) or 'none'})"
                )
            name = m.get("name")
            if name is not None and name != pending[call_id]:
                return f"unmatched_tool_result: message {i}: name {name!r} but call {call_id!r} is to {pending[call_id]!r}"
            del pending[call_id]
        elif pending:
            return f"not_alternating: message {i}: role {role!r} while calls {sorted(pending)} have no tool result"
        elif role != "system":
            want = {None: "user", "user": "assistant", "tool": "assistant"}.get(previous, "user")
            if role != want:
                return f"not_alternating: message {i}: role {role!r} where {want!r} was expected (user and assistant alternate, user first)"
        for k, call in enumerate(calls):
            problem = _tool_call_problem(i, k, call, seen)
            if problem:
                return problem
            seen.add(call["id"])
            pending[call["id"]] = call["function"]["name"]
        previous = role
    if "assistant" not in roles:
        return "no_assistant: no assistant turn"
    return None


def _v1_problem(messages: Sequence[Mapping[str, Any]]) -> str | None:
    if not messages:
        return "empty_turn: no messages"
    roles = [m.get("role") for m in messages]
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            return f"unknown_role: message {i}: role {m.get('role')!r} (expected system, user or assistant)"
        if not isinstance(m.get("content"), str) or not m["content"].strip():
            return f"empty_turn: message {i} ({m.get('role')}) has empty content"
    offset = 1 if roles[0] == "system" else 0
    turns = roles[offset:]
    if "system" in turns:
        return f"not_alternating: message {roles.index('system', 1)}: a system message is allowed only first"
    for i, role in enumerate(turns):
        want = "user" if i % 2 == 0 else "assistant"
        if role != want:
            return f"not_alternating: message {i + offset}: role {role!r} where {want!r} was expected (user and assistant alternate, user first)"
    if "assistant" not in turns:
        return "no_assistant: no assistant turn"
    return None


def select_rows(
    ids: Sequence[str], max_samples: int | None, sample_seed: int | None = None
) -> list[int]:
    """The rows a stage takes, in file order: all, the first ``max_samples``, or (with
    ``sample_seed``) ``max_samples`` rows drawn at random.

    The draw keeps the rows whose ``blake2b(f"{seed}:{id}")`` is smallest: the same seed picks
    the same samples on any machine and numpy version, and whatever the file's row order.
    """
    count = len(ids) if max_samples is None else min(max_samples, len(ids))
    if sample_seed is None:
        return list(range(count))
    keys = (
        (hashlib.blake2b(f"{sample_seed}:{sample_id}".encode(), digest_size=8).digest(), row)
        for row, sample_id in enumerate(ids)
    )
    return sorted(row for _, row in heapq.nsmallest(count, keys))


def describe_selection(max_samples: int | None, sample_seed: int | None) -> str:
    """How ``select_rows`` chose, in words, for an artifact header."""
    if max_samples is None:
        return "all rows"
    if sample_seed is None:
        return f"the first {max_samples} rows"
    return (
        f"{max_samples} rows at random: the smallest blake2b('{sample_seed}:' + id) "
        "(8-byte digest), kept in file order"
    )
