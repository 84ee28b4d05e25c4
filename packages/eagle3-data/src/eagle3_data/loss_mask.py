"""Assistant-only loss masks from any chat template, with or without ``{% generation %}`` tags.

Most real templates (Qwen3's, Kimi's) have no generation tags, so the mask cannot come from
them. Instead the conversation is rendered once and every assistant turn's content is found
verbatim in the rendered text, searching forward turn by turn, so an answer quoted in a
later user message is never matched. The trained span is the content plus the text the
template closes every assistant turn with (e.g. ``<|im_end|>``: the model must learn to stop),
without trailing whitespace — the same span generation tags mark. A token is trained when it
overlaps a trained span, which is how transformers turns generation tags into token masks.

Thinking blocks: where the template renders the turn's reasoning, it is trained from its
``<think>`` onwards; where the template drops it (Qwen3 drops reasoning of earlier turns),
only the visible answer is trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
PROBE = "EAGLE3-PROBE-ANSWER"


class MaskError(ValueError):
    """The rendered text does not let the assistant turns be located; the sample is rejected."""


@dataclass(frozen=True)
class ChatRenderer:
    """Renders conversations with a tokenizer's chat template and finds the trained spans."""

    tokenizer: Any  # a transformers PreTrainedTokenizerBase
    closing: str  # what the template appends to every assistant turn's content ('' if nothing)

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> ChatRenderer:
        if not tokenizer.chat_template:
            raise MaskError(
                "the tokenizer has no chat template; a target's template is needed to render samples"
            )
        probe = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": PROBE}]
        rendered = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
        after = rendered[rendered.rindex(PROBE) + len(PROBE) :]
        return cls(tokenizer, after.rstrip())

    def render(self, messages: Sequence[dict[str, str]]) -> str:
        # Always explicit: Kimi's tokenizer code defaults to appending the generation prompt,
        # which would make the next assistant header look like part of every answer's closing.
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=False
        )

    def trained_spans(self, messages: Sequence[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """Character spans of ``text`` the model is trained to produce, one per assistant turn."""
        spans, cursor = [], 0
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] != "assistant":
                found = text.find(content, cursor)
                cursor = found + len(content) if found >= 0 else cursor
                continue
            start, end = _locate_answer(text, content, cursor)
            if start < 0:
                raise MaskError(
                    f"template_mismatch: assistant turn {i}: its content does not appear verbatim in the rendered text"
                )
            if self.closing and text.startswith(self.closing, end):
                end += len(self.closing)
            spans.append((start, end))
            cursor = end
        return spans


def _locate_answer(text: str, content: str, cursor: int) -> tuple[int, int]:
    found = text.find(content, cursor)
    if found >= 0:
        return found, found + len(content)
    # Templates that trim message contents (Llama-3.x's `| trim`) render the answer without
    # its surrounding whitespace: that is still the answer, not a rewrite.
    stripped = content.strip()
    if stripped != content and stripped:
        found = text.find(stripped, cursor)
        if found >= 0:
            return found, found + len(stripped)
    if THINK_CLOSE not in content:
        return -1, -1
    reasoning, visible = content.split(THINK_CLOSE, 1)
    visible = visible.lstrip("\n")
    found = text.find(visible, cursor) if visible.strip() else -1
    if found < 0:
        return -1, -1
    reasoning = reasoning.split(THINK_OPEN, 1)[-1].strip("\n")
    rendered_reasoning = text.rfind(reasoning, cursor, found) if reasoning.strip() else -1
    think = text.rfind(THINK_OPEN, cursor, rendered_reasoning) if rendered_reasoning >= 0 else -1
    return (think if think >= 0 else found), found + len(visible)


def token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose character range [start, end) overlaps a span."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if len(offsets) == 0:
        return mask
    starts, ends = offsets[:, 0], offsets[:, 1]
    for a, b in spans:
        mask[(starts < b) & (ends > a)] = 1
    return mask
