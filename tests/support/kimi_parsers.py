"""Run with vLLM's Python: the stand-in renders an agent turn with its chat template, and vLLM's
``kimi_k2`` reasoning and tool-call parsers read back what the target would have produced.

    python -m support.kimi_parsers STANDIN_DIR   (prints one JSON line)
    python -m support.kimi_parsers TARGET_DIR COMPLETIONS.json   (one JSON line: each parsed)

The second form reads a target's own generations (a JSON list of {completion, tools,
thinking}, each completion without its closing ``<|im_end|>``) and prints what the parsers
make of each: reasoning, content, calls.

The turn is rendered in the middle of an agent loop (the template keeps its reasoning there),
and its completion is the rendered text after the prompt with its generation prompt, less the
closing ``<|im_end|>`` (vLLM stops on it): exactly the text the parsers get from a served target.
"""

from __future__ import annotations

import json
import sys

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.reasoning import ReasoningParserManager
from vllm.tool_parsers import ToolParserManager

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TURN = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "I need both cities.",
    "tool_calls": [
        {
            "id": f"functions.get_weather:{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        for i, city in enumerate(["Paris", "Rome"])
    ],
}
MESSAGES = [{"role": "user", "content": "Weather in Paris and Rome?"}]


def parse(tokenizer, completion: str, tools: list, thinking: bool) -> dict:
    """What vLLM's kimi_k2 reasoning and tool parsers read from a served completion."""
    kwargs = {"thinking": thinking}
    request = ChatCompletionRequest(
        model="target", messages=MESSAGES, tools=tools, chat_template_kwargs=kwargs
    )
    reasoning_parser = ReasoningParserManager.get_reasoning_parser("kimi_k2")
    reasoning, content = reasoning_parser(tokenizer, chat_template_kwargs=kwargs).extract_reasoning(
        completion, request
    )
    tool_parser = ToolParserManager.get_tool_parser("kimi_k2")(tokenizer, tools=request.tools)
    calls = tool_parser.extract_tool_calls(content or "", request)
    return {
        "completion": completion,
        "reasoning": reasoning,
        "content": calls.content,
        "tool_calls": [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in calls.tool_calls
        ],
    }


def parse_all(target: str, completions_path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    with open(completions_path, encoding="utf-8") as f:
        items = json.load(f)
    print(json.dumps([parse(tokenizer, i["completion"], i["tools"], i["thinking"]) for i in items]))


def main(standin: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(
        standin, trust_remote_code=True, local_files_only=True
    )
    kwargs = {"thinking": True}
    prompt = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False, **kwargs
    )
    full = tokenizer.apply_chat_template(
        [*MESSAGES, TURN], tools=TOOLS, add_generation_prompt=False, tokenize=False, **kwargs
    )
    assert full.startswith(prompt) and full.endswith("<|im_end|>"), (prompt, full)
    completion = full[len(prompt) : -len("<|im_end|>")]
    print(json.dumps({**parse(tokenizer, completion, TOOLS, True), "expected": TURN}))


if __name__ == "__main__":
    if len(sys.argv) == 3:
        parse_all(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1])
