"""Tiny random-weight targets of other architectures, built from a config in seconds.

They stand in for real targets in tests of code paths that depend on the architecture
(hidden-state extraction, layer ids, dtypes). Their weights are random, so they say nothing
about draft quality: the trained default target in ``recipes/tiny/target`` is for that.

- ``build_tiny_qwen3(dir)``: a Qwen3 (GQA, per-head q/k norms), 2 layers.
- ``build_tiny_deepseek_v3(dir)``: a DeepseekV3 laid out like Kimi-K2.5 — MLA attention with
  ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 (the only MLA head size vLLM's CPU backend
  supports), first layer dense (``first_k_dense_replace=1``), then MoE with 8 routed experts,
  top-2, 1 shared expert, ``noaux_tc`` routing with sigmoid scores. bf16 by default.

Both reuse the tokenizer files of the trained default target, so the vocabulary (4,096 tokens)
and the ChatML template are the project's own.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen3Config,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_SOURCE = REPO_ROOT / "recipes" / "tiny" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _special_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    return {
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    }


def _load_tokenizer(source: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(source, local_files_only=True)


def _save(
    config: PretrainedConfig, out_dir: Path, source: Path, seed: int, dtype: torch.dtype
) -> Path:
    """Random weights from `config` (seeded), saved with the tokenizer files of `source`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(dtype)
    model.config.dtype = dtype
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copyfile(source / name, out_dir / name)
    return out_dir


# Each architecture's config class and its shape, beside the vocabulary and special tokens
# of the tokenizer files.
ARCHITECTURES: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "qwen3": (
        Qwen3Config,
        {
            "hidden_size": 128,
            "intermediate_size": 384,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "tie_word_embeddings": False,
        },
    ),
    "deepseek_v3": (
        DeepseekV3Config,
        {
            "hidden_size": 128,
            "intermediate_size": 256,  # the dense first layer
            "moe_intermediate_size": 64,  # each routed and shared expert
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            # MLA: vLLM's CPU backend supports only kv_lora_rank + qk_rope_head_dim = 576.
            "q_lora_rank": 96,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            # MoE laid out like Kimi-K2.5, scaled down.
            "first_k_dense_replace": 1,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.827,
            "topk_method": "noaux_tc",  # read by vLLM's loader (e_score_correction_bias)
            "scoring_func": "sigmoid",
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 50_000.0},
            "rope_interleave": True,
            "tie_word_embeddings": False,
        },
    ),
}


def build_tiny(
    architecture: str,
    out_dir: Path,
    *,
    tokenizer_source: Path = TOKENIZER_SOURCE,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A tiny random-weight target of ``architecture`` (a key of ``ARCHITECTURES``)."""
    config_class, shape = ARCHITECTURES[architecture]
    tokenizer = _load_tokenizer(tokenizer_source)
    config = config_class(vocab_size=len(tokenizer), **shape, **_special_ids(tokenizer))
    return _save(config, out_dir, tokenizer_source, seed, dtype)


build_tiny_qwen3 = functools.partial(build_tiny, "qwen3")
build_tiny_deepseek_v3 = functools.partial(build_tiny, "deepseek_v3")
