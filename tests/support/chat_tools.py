"""The get_weather tool and a call of it, as the chat tests declare, serve and render them.

- ``WEATHER_TOOLS``: get_weather as a client declares it, described, with a city argument.
- ``KIMI_TOOLS``: the bare declaration the Kimi template tests render, and ``KIMI_SERVED_TOOLS``
  what vLLM hands the template for it (``ChatCompletionToolsParam.model_dump()``): a missing
  description is null (tests/test_tools_as_served.py checks against vLLM itself).
- ``KIMI_CALL``: a call of it with Kimi's id (``functions.NAME:INDEX``); ``KIMI_RESULT``: its
  result message; ``KIMI_AGENT_LOOP``: the middle of an agent loop, a question, the call with
  its reasoning, the result.
- ``KIMI_TEMPLATE``: the Kimi stand-in's chat template (Kimi-K2.5's structure).
"""

from __future__ import annotations

from pathlib import Path

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]

KIMI_TEMPLATE = Path(__file__).resolve().parent / "kimi_standin_files" / "chat_template.jinja"
KIMI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]
KIMI_SERVED_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": None, "parameters": {"type": "object"}},
    }
]
KIMI_CALL = {
    "id": "functions.get_weather:0",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
KIMI_RESULT = {
    "role": "tool",
    "content": "12 C",
    "tool_call_id": "functions.get_weather:0",
    "name": "get_weather",
}
KIMI_AGENT_LOOP = [
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Look it up.",
        "tool_calls": [KIMI_CALL],
    },
    KIMI_RESULT,
]
