"""Run with vLLM's Python: the prompt ids vLLM's chat endpoint serves for chat requests, rendered
by its own request path without an engine (the request model, OnlineRenderer.render_chat: tool
normalisation, chat template, tokenization).

    python -m support.vllm_chat_render TARGET REQUESTS.json [--trust-remote-code]

REQUESTS.json is a JSON list of chat request bodies ({messages, tools, chat_template_kwargs});
prints one JSON line: each request's prompt token ids.
"""

from __future__ import annotations

import asyncio
import json
import sys

from vllm.config import ModelConfig, VllmConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.renderers.registry import renderer_from_config


def main(target: str, requests_path: str, trust_remote_code: bool) -> None:
    config = ModelConfig(model=target, trust_remote_code=trust_remote_code)
    renderer = OnlineRenderer(
        config,
        renderer_from_config(VllmConfig(model_config=config)),
        request_logger=None,
        chat_template=None,
        chat_template_content_format="auto",
        # As the agent recipes serve: tool calls parsed, so requests may declare tools.
        enable_auto_tools=True,
        tool_parser="kimi_k2",
        reasoning_parser="kimi_k2",
    )
    with open(requests_path, encoding="utf-8") as f:
        bodies = json.load(f)
    ids = []
    for body in bodies:
        request = ChatCompletionRequest(model=target, **body)
        result = asyncio.run(renderer.render_chat(request))
        if not isinstance(result, tuple):  # an ErrorResponse: vLLM refused the request
            sys.exit(f"vLLM refused {body}: {result}")
        _, (engine_input,) = result
        ids.append(engine_input["prompt_token_ids"])
    print(json.dumps(ids))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--trust-remote-code" in sys.argv[3:])
