"""The Kimi stand-in's chat template in Kimi-K2.5's structure (issue 42), golden renders:
instant mode, thinking across several turns, and the middle of an agent loop.

The structure (Kimi-K2-Thinking's chat_template.jinja, which K2.5 shares): the messages split
at the last assistant turn without tool calls; every assistant turn up to it renders
``<think></think>`` + content, later ones keep ``<think>reasoning</think>`` before their tool
calls; tools are declared first (``tool_declare``), then Kimi's default system prompt when the
conversation has none; tool results are ``<|im_system|>tool<|im_middle|>## Return of ID``; the
generation prompt ends in ``<think>`` (thinking) or ``<think></think>`` (instant).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils.chat_template_utils import _compile_jinja_template

from support.chat_tools import (
    KIMI_AGENT_LOOP,
    KIMI_SERVED_TOOLS,
    KIMI_TEMPLATE,
    KIMI_TOOLS,
)

SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
DECLARE = "<|im_system|>tool_declare<|im_middle|>" + json.dumps(KIMI_TOOLS) + "<|im_end|>"
CHAT = [
    {"role": "user", "content": "Add?"},
    {"role": "assistant", "content": "2", "reasoning_content": "1+1"},
    {"role": "user", "content": "Mul?"},
    {"role": "assistant", "content": "4", "reasoning_content": "2*2"},
]
AGENT = [{"role": "system", "content": "Use tools."}, *KIMI_AGENT_LOOP]
CALL_TEXT = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>'
)


@pytest.fixture(scope="module")
def render():
    template = _compile_jinja_template(KIMI_TEMPLATE.read_text(encoding="utf-8"))
    return lambda messages, **kwargs: template.render(messages=messages, **kwargs)


def test_instant_mode(render) -> None:
    assert render(CHAT[:3], add_generation_prompt=True, thinking=False) == (
        SYSTEM + "<|im_user|>user<|im_middle|>Add?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>2<|im_end|>"
        "<|im_user|>user<|im_middle|>Mul?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>"
    )


def test_thinking_across_several_turns_drops_the_history_reasoning(render) -> None:
    # A whole training conversation never shows reasoning: every answer is history.
    assert render(CHAT) == (
        SYSTEM + "<|im_user|>user<|im_middle|>Add?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>2<|im_end|>"
        "<|im_user|>user<|im_middle|>Mul?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>"
    )
    # The prompt of the next turn opens a think block for the target to fill.
    assert render(CHAT[:3], add_generation_prompt=True).endswith(
        "<|im_user|>user<|im_middle|>Mul?<|im_end|><|im_assistant|>assistant<|im_middle|><think>"
    )


def test_the_middle_of_an_agent_loop_keeps_the_reasoning_before_the_call(render) -> None:
    assert render(AGENT, tools=KIMI_TOOLS, add_generation_prompt=True) == (
        DECLARE + "<|im_system|>system<|im_middle|>Use tools.<|im_end|>"
        "<|im_user|>user<|im_middle|>Weather?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>Look it up.</think>"
        + CALL_TEXT
        + "<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\n12 C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    # thinking=false empties the later turns' blocks too, not only the generation prompt's
    instant = render(AGENT, tools=KIMI_TOOLS, add_generation_prompt=True, thinking=False)
    assert "<think>Look it up.</think>" not in instant and instant.endswith("<think></think>")
    # once the loop ends in an answer, the call becomes history and its reasoning goes
    done = [*AGENT, {"role": "assistant", "content": "12 C.", "reasoning_content": "read"}]
    assert "<think></think>" + CALL_TEXT in render(done, tools=KIMI_TOOLS)
    assert "Look it up." not in render(done, tools=KIMI_TOOLS)


def test_every_prompt_is_a_prefix_of_the_conversation_through_its_answer(render) -> None:
    """What tokenize's per-event rendering needs: prompt (with the generation prompt) + the
    target's completion = the conversation rendered through that turn, in the agent loop."""
    prompt = render(AGENT[:3][:2], tools=KIMI_TOOLS, add_generation_prompt=True)
    through = render(AGENT[:3], tools=KIMI_TOOLS)
    assert through.startswith(prompt)
    assert through[len(prompt) :] == "Look it up.</think>" + CALL_TEXT + "<|im_end|>"


def test_tokenize_renders_each_event_as_served() -> None:
    """tokenize's per-event texts with this template (on a real tokenizer): the prompt as vLLM
    renders it, and the completion the target produced, with its reasoning, in the agent loop
    and for the answer that ends it (where the whole render drops every reasoning)."""
    from eagle3_data.loss_mask import ChatRenderer
    from eagle3_data.tokenization import event_texts, load_tokenizer

    from support.recipe_standins import qwen3_tokenizer_dir

    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    tokenizer.chat_template = KIMI_TEMPLATE.read_text(encoding="utf-8")
    renderer = ChatRenderer.for_tokenizer(tokenizer)
    done = [*AGENT, {"role": "assistant", "content": "12 C.", "reasoning_content": "read"}]
    tools = json.dumps(KIMI_TOOLS)
    for turn, completion in ((2, "Look it up.</think>" + CALL_TEXT), (4, "read</think>12 C.")):
        prompt, got = event_texts(renderer, done, turn, tools, "thinking")
        served = tokenizer.apply_chat_template(
            done[:turn], tools=KIMI_SERVED_TOOLS, add_generation_prompt=True, tokenize=False
        )
        assert prompt == served and prompt.endswith("<think>")
        assert got == completion + "<|im_end|>"


@pytest.mark.parametrize("mode", ["thinking", "instant"])
def test_eval_renders_an_agent_prompt_as_tokenize_renders_its_event(
    tmp_path: Path, mode: str
) -> None:
    """eagle3-eval's prompt of an agent row (ending after the tool result) is, token for token,
    the loss-0 prefix tokenize writes for that generation event: one contract renders both
    (eagle3_schemas.layouts.conversations.render_prompt)."""
    from eagle3_data.loss_mask import ChatRenderer
    from eagle3_data.tokenization import encode_events, load_tokenizer
    from eagle3_eval.prompts import PromptSelection, PromptSource, build_prompt_set

    from support.recipe_standins import qwen3_tokenizer_dir

    tokenizer = load_tokenizer(qwen3_tokenizer_dir())
    tokenizer.chat_template = KIMI_TEMPLATE.read_text(encoding="utf-8")
    # an instant answer carries no reasoning (tokenize refuses one the template would drop)
    reasoning = {"reasoning_content": "read"} if mode == "thinking" else {}
    done = [*AGENT, {"role": "assistant", "content": "12 C.", **reasoning}]
    row = {"messages": done, "tools": KIMI_TOOLS, "mode": mode, "split": "heldout"}
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    selection = PromptSelection((PromptSource(None, tmp_path / "p.jsonl"),))
    (prompt,) = build_prompt_set(selection, tokenizer).prompts
    assert prompt.kind == "agent"
    events = encode_events(
        ChatRenderer.for_tokenizer(tokenizer), "x", "s", done, json.dumps(KIMI_TOOLS), mode, 10**6
    )
    last = events[-1]  # the answer after the tool result: the event eval's prompt asks for
    assert last.error is None and last.loss_mask is not None and last.input_ids is not None
    loss_free = int((last.loss_mask == 0).sum())
    assert prompt.token_ids == last.input_ids[:loss_free].tolist()
