"""Inference-side drafts the tests build: untrained ones, and checkpoints written in the
speculators format that eagle3-eval and vLLM read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eagle3_eval.draft import Eagle3Draft
from eagle3_eval.draft_spec import CONFIG_FILE, LINEAGE_FILE, WEIGHTS_FILE, DraftSpec
from eagle3_schemas.contract.header import write_safetensors
from eagle3_schemas.io.atomic import atomic_directory, write_json_atomic
from eagle3_schemas.layouts.draft_vocab import stores_vocab_map

# A YaRN rope_scaling block as a long-context target's config.json writes it (the legacy "type"
# key): 64 times the 4,096 positions it was trained on.
YARN = {
    "type": "yarn",
    "factor": 64.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
}


def random_draft(
    spec: DraftSpec, embed_tokens: Tensor, d2t: Tensor | None = None, seed: int = 0
) -> Eagle3Draft:
    """An untrained draft (small normal init): the control that must score about 1.0."""
    generator = torch.Generator().manual_seed(seed)
    model = Eagle3Draft(spec, embed_tokens)
    with torch.no_grad():
        for module in model.checkpoint_modules().values():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
        if d2t is not None:
            model.d2t.copy_(d2t)
    return model.eval()


def vocab_t2d(d2t: Tensor, target_vocab_size: int) -> Tensor:
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    return t2d


def checkpoint_tensors(model: Eagle3Draft) -> dict[str, Tensor]:
    """The draft's tensors under their checkpoint names, ``t2d`` derived from ``d2t``; neither
    for a full vocabulary (eagle3_schemas.layouts.draft_vocab: vLLM refuses a d2t there)."""
    out: dict[str, Tensor] = {}
    for prefix, module in model.checkpoint_modules().items():
        out[f"{prefix}.weight"] = module.weight.detach()
        if getattr(module, "bias", None) is not None:
            out[f"{prefix}.bias"] = module.bias.detach()
    if stores_vocab_map(len(model.d2t), model.spec.target_vocab_size):
        out["d2t"] = model.d2t.clone()
        out["t2d"] = vocab_t2d(model.d2t, model.spec.target_vocab_size)
    return out


def save_draft(
    model: Eagle3Draft,
    directory: str | Path,
    config: dict[str, Any],
    lineage_header: dict[str, Any] | None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a draft checkpoint: config.json, model.safetensors, eagle3.json.

    ``config`` is the config.json object (e.g. ``speculators_config``), ``lineage_header`` the
    eagle3.json object or None. Atomic: the directory appears complete or not at all.
    """
    tensors = {
        k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
        for k, v in checkpoint_tensors(model).items()
    }
    with atomic_directory(directory) as tmp:
        write_safetensors(tmp / WEIGHTS_FILE, tensors)
        write_json_atomic(tmp / CONFIG_FILE, config)
        if lineage_header is not None:
            write_json_atomic(tmp / LINEAGE_FILE, lineage_header)
    return Path(directory)


def speculators_config(
    *,
    target_config: dict[str, Any],
    verifier_path: str,
    aux_layer_ids: list[int],
    draft_vocab_size: int,
    num_speculative_tokens: int = 3,
    intermediate_size: int | None = None,
    norm_before_residual: bool = False,
) -> dict[str, Any]:
    """config.json of a one-layer draft for a Llama-like target (sizes from its config)."""
    hidden = int(target_config["hidden_size"])
    heads = int(target_config["num_attention_heads"])
    rope_theta = target_config.get("rope_theta") or (
        target_config.get("rope_parameters") or {}
    ).get("rope_theta", 10000.0)
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": int(target_config.get("num_key_value_heads") or heads),
        "head_dim": int(target_config.get("head_dim") or hidden // heads),
        "intermediate_size": int(intermediate_size or target_config["intermediate_size"]),
        "vocab_size": int(target_config["vocab_size"]),
        "rms_norm_eps": float(target_config["rms_norm_eps"]),
        "num_hidden_layers": 1,
        "max_position_embeddings": int(target_config.get("max_position_embeddings", 2048)),
        "rope_theta": float(rope_theta),
        "hidden_act": target_config.get("hidden_act", "silu"),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": draft_vocab_size,
        "norm_before_residual": norm_before_residual,
        "target_hidden_size": hidden,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}
            ],
            "verifier": {
                "name_or_path": verifier_path,
                "architectures": target_config.get("architectures", ["LlamaForCausalLM"]),
            },
        },
    }
