"""Scaled-down stand-ins of the public targets in tests/fixtures/public_targets, for running a
generated recipe's stage preflights: recipe_standins' scaling (same keys, GQA group, MLP ratio,
real vocabulary, depth / 4) plus the MoE sizes, with a tokenizer of the family's format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support import recipe_standins

# The offline tokenizers: Qwen's real one serves the Qwen families; the Llama-3.1-format BPE
# serves Llama and Mistral (its ids fit both vocabularies).
TOKENIZERS = {
    "llama": recipe_standins._save_llama3_format_tokenizer,
    "mistral": recipe_standins._save_llama3_format_tokenizer,
    "qwen2": recipe_standins._save_qwen3_tokenizer,
    "qwen3": recipe_standins._save_qwen3_tokenizer,
    "qwen3_moe": recipe_standins._save_qwen3_tokenizer,
}
STANDIN_EXPERTS = 8
MIN_LAYERS = 7


def standin_config(facts: dict[str, Any]) -> dict[str, Any]:
    config = recipe_standins.standin_config(facts)
    # At least 7 layers: [2, N//2, N-3] in its regular form (Llama-3.2-1B has 16: 16 / 4 = 4).
    config["num_hidden_layers"] = max(MIN_LAYERS, config["num_hidden_layers"])
    if "max_window_layers" in config:
        config["max_window_layers"] = config["num_hidden_layers"]
    if "num_experts" in facts:  # Qwen3-MoE: fewer, narrower experts, the same top-k ratio kept
        config["num_experts"] = STANDIN_EXPERTS
        config["num_experts_per_tok"] = max(
            1, facts["num_experts_per_tok"] * STANDIN_EXPERTS // facts["num_experts"]
        )
        config["moe_intermediate_size"] = round(
            facts["moe_intermediate_size"] * config["hidden_size"] / facts["hidden_size"]
        )
    return config


def build(facts: dict[str, Any], out_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of ``facts``' architecture at stand-in size with a tokenizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config = standin_config(facts) | TOKENIZERS[facts["model_type"]](out_dir)
    return recipe_standins.write_model(config, facts, out_dir, seed)
