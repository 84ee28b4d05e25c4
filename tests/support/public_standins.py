"""Scaled-down stand-ins of the public targets in tests/fixtures/public_targets, for running a
generated recipe's stage preflights: recipe_standins' scaling (same keys, GQA group, MLP ratio,
real vocabulary, depth / 4) plus the MoE sizes, with a tokenizer of the family's format.

The MLA + MoE targets take the Kimi stand-in's sizes (tests/support/kimi_standin.py): the real
``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64, hidden 128, depth / 8, 8 routed experts top-2.
Kimi-K2.5 is that stand-in itself (its wrapper, its tokenizer as remote code). DeepSeek-V3 keeps
its config's keys but two: ``auto_map`` (transformers and vLLM have a native DeepseekV3 class, so
the stand-in ships no model code) and ``quantization_config`` (fp8 blocks do not run on CPU:
the weights are bf16, as the Kimi stand-in's INT4 experts are); its tokenizer is the project's BPE
with DeepSeek-V3's special tokens and the fixture's chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from support import kimi_standin, public_targets, recipe_standins

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
# DeepSeek-V3's tokenizer (LlamaTokenizerFast): BOS, EOS and the chat template's role markers.
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DEEPSEEK_SPECIAL_TOKENS = (DEEPSEEK_BOS, DEEPSEEK_EOS, "<｜User｜>", "<｜Assistant｜>")
MLA_DROPPED = ("auto_map", "quantization_config")


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


def mla_standin_config(facts: dict[str, Any]) -> dict[str, Any]:
    """A DeepSeek-V3-style config at the Kimi stand-in's sizes; expert groups scaled so that
    each group still holds two experts (the router takes each group's top two)."""
    config = {k: v for k, v in facts.items() if k not in MLA_DROPPED}
    config.update(
        kimi_standin.STANDIN_TEXT,
        num_hidden_layers=facts["num_hidden_layers"] // kimi_standin.DEPTH_DIVISOR,
    )
    groups = max(1, min(facts["n_group"], STANDIN_EXPERTS // 2))
    config["n_group"] = groups
    config["topk_group"] = max(1, facts["topk_group"] * groups // facts["n_group"])
    return config


def _save_deepseek_tokenizer(out_dir: Path, chat_template: str) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        recipe_standins.TINY_TOKENIZER, local_files_only=True
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(DEEPSEEK_SPECIAL_TOKENS)})
    tokenizer.bos_token, tokenizer.eos_token = DEEPSEEK_BOS, DEEPSEEK_EOS
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    ids = tokenizer.convert_tokens_to_ids
    return {"bos_token_id": ids(DEEPSEEK_BOS), "eos_token_id": ids(DEEPSEEK_EOS)}


def build(name: str, out_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of the public target ``name``'s architecture at stand-in size with
    a tokenizer of its format."""
    fixture = public_targets.facts(name)
    facts = fixture["config"]
    out_dir = Path(out_dir)
    if facts["model_type"] == "kimi_k25":  # the Kimi stand-in is built from the same config
        assert facts == kimi_standin.target_facts(), "the Kimi stand-in's config drifted"
        return kimi_standin.build_standin(out_dir, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    if facts["model_type"] == "deepseek_v3":
        template = fixture["tokenizer_config"]["chat_template"]
        config = mla_standin_config(facts) | _save_deepseek_tokenizer(out_dir, template)
    else:
        config = standin_config(facts) | TOKENIZERS[facts["model_type"]](out_dir)
    return recipe_standins.write_model(config, facts, out_dir, seed)
