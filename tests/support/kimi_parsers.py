"""Run with vLLM's Python: the stand-in renders an agent turn with its chat template, and vLLM's
``kimi_k2`` reasoning and tool-call parsers read back what the target would have produced.

    python -m support.kimi_parsers STANDIN_DIR   (prints one JSON line)

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
    request = ChatCompletionRequest(
        model="standin", messages=MESSAGES, tools=TOOLS, chat_template_kwargs=kwargs
    )
    reasoning_parser = ReasoningParserManager.get_reasoning_parser("kimi_k2")
    reasoning, content = reasoning_parser(tokenizer, chat_template_kwargs=kwargs).extract_reasoning(
        completion, request
    )
    tool_parser = ToolParserManager.get_tool_parser("kimi_k2")(tokenizer, tools=request.tools)
    calls = tool_parser.extract_tool_calls(content or "", request)
    print(
        json.dumps(
            {
                "completion": completion,
                "reasoning": reasoning,
                "content": calls.content,
                "tool_calls": [
                    {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                    for c in calls.tool_calls
                ],
                "expected": TURN,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1])
