"""Regeneration: sampling, thinking mix, answer cap, tool data and vLLM's parsers; the samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3_recipe.rules.base import TRAFFIC_MIX, Decision
from eagle3_recipe.target import Target

# ---- regeneration ---------------------------------------------------------------------------

# (temperature, top_p) where the model has no generation_config.json.
FAMILY_SAMPLING = {"llama": (0.6, 0.9)}
DEFAULT_SAMPLING = (0.6, 0.95)
ANSWER_TOKENS = 2048  # a non-thinking answer's cap (the Llama recipe's --max-tokens)
THINKING_TOKENS = {"kimi_k2": 16384, "deepseek_v3": 16384}  # the vendors ask for >= 16,000
QWEN_THINKING_TOKENS = 6144
PROMPT_TOKENS = 2048  # room for the prompt beside the answer in MAX_LENGTH


@dataclass(frozen=True)
class Regeneration:
    temperature: float
    top_p: float
    max_tokens: int
    thinking_fraction: float | None
    tools: bool
    reasoning_parser: str | None
    tool_parser: str | None


def regeneration(t: Target, generation_config: dict[str, Any]) -> Decision:
    tok = t.tokenizer
    family_sampling = FAMILY_SAMPLING.get(t.family_key, DEFAULT_SAMPLING)
    given = generation_config.get("temperature")  # null: not given
    temperature = float(given if given is not None else family_sampling[0])
    top_p = generation_config.get("top_p")
    top_p = float(top_p if top_p is not None else family_sampling[1])
    source = "generation_config.json" if given is not None else "family default"
    reasons = [
        f"sampling T {temperature:g}, top-p {top_p:g} ({source}): the answers a served "
        "target gives, on-policy for the draft"
    ]
    if tok.thinks:
        max_tokens = THINKING_TOKENS.get(t.family_key, QWEN_THINKING_TOKENS)
        fraction: float | None = 0.75
        reasons.append(
            f"the template thinks (<think>; switch '{tok.thinking_switch}'): 3 rows in 4 in "
            f"thinking mode, 1 in 4 without (--thinking-fraction 0.75; the mix measured best on "
            f"thinking traffic and over all prompts: {TRAFFIC_MIX}); --max-tokens {max_tokens:,} "
            "(reasoning runs to thousands of tokens; a cut answer is rejected and counted)"
        )
        reasoning = t.family.reasoning_parser
    else:
        max_tokens, fraction, reasoning = ANSWER_TOKENS, None, None
        reasons.append(f"no thinking mode in the template: --max-tokens {max_tokens:,}")
    tool_parser = t.family.tool_parser if tok.declares_tools else None
    if tok.declares_tools:
        reasons.append(
            "the template declares tools: rows with tools are sent with them and their tool "
            "results spliced (a draft that never saw a tool call reads agent traffic at ~1.1, "
            f"{TRAFFIC_MIX}); {t.family.tool_parser_reason}"
        )
    if reasoning:
        reasons.append(f"vLLM --reasoning-parser {reasoning} returns reasoning_content")
    value = Regeneration(
        temperature, top_p, max_tokens, fraction, tok.declares_tools, reasoning, tool_parser
    )
    return Decision("regeneration", value, "; ".join(reasons))


def samples(regen: Regeneration) -> Decision:
    if regen.thinking_fraction:
        return Decision(
            "samples",
            20000,
            "20,000 conversations: with 3 in 4 thinking (~6,000-token answers) they hold ~100M "
            "tokens (the Qwen3-8B and Kimi-K2.5 recipes' size)",
        )
    return Decision(
        "samples",
        40000,
        "40,000 conversations of ~2,000 tokens: ~80M tokens (the Llama-3.1-8B recipe's size)",
    )


def expected_tokens(n: int, regen: Regeneration) -> int:
    """An estimate (recipes/kimi-k2.5/RESOURCES.md): answers of ~1,500 tokens, thinking ones of
    ~6,000, a ~500-token prompt each."""
    thinking = regen.thinking_fraction or 0.0
    return round(n * ((1 - thinking) * 1500 + thinking * 6000 + 500))
