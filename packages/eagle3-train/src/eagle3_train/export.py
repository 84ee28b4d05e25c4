"""Write the draft as a speculators-format eagle3 checkpoint that vLLM serves as is.

Directory (schemas/draft_checkpoint/v1.json): ``config.json`` (speculators eagle3 layout),
``model.safetensors`` (weights under vLLM's names, plus ``d2t`` offsets and ``t2d``) and
``eagle3.json`` (header + lineage). Written into a temporary directory and renamed, so a
crash never leaves something that looks like a finished checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_schemas.atomic import atomic_directory, write_json_atomic
from eagle3_schemas.header import make_header, write_json_header, write_safetensors
from eagle3_schemas.lineage import fingerprint_vocab_map
from eagle3_train.model import DraftArch

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# speculators release whose eagle3 format (config.json layout, tensor names) this writes.
SPECULATORS_FORMAT_VERSION = "0.9.0"


def transformer_layer_config(arch: DraftArch) -> dict[str, Any]:
    rope_parameters = {**(arch.rope_scaling or {}), "rope_theta": arch.rope_theta}
    rope_parameters.setdefault("rope_type", "default")
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": arch.hidden_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads,
        "head_dim": arch.head_dim,
        "intermediate_size": arch.intermediate_size,
        "vocab_size": arch.target_vocab_size,
        "rms_norm_eps": arch.rms_norm_eps,
        "num_hidden_layers": arch.num_layers,
        "max_position_embeddings": arch.max_position_embeddings,
        # transformers 5 reads rope_parameters; older readers rope_theta / rope_scaling.
        "rope_parameters": rope_parameters,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "hidden_act": arch.hidden_act,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def draft_config(
    arch: DraftArch,
    aux_layer_ids: list[int],
    verifier_name_or_path: str | None,
    verifier_architectures: list[str],
    speculative_tokens: int,
) -> dict[str, Any]:
    """config.json in speculators' eagle3 layout (what vLLM's speculators parser reads)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_FORMAT_VERSION,
        "draft_vocab_size": arch.draft_vocab_size,
        "target_hidden_size": arch.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        "norm_before_residual": arch.norm_before_residual,
        "norm_before_fc": arch.norm_before_fc,
        "norm_output": arch.norm_output,
        "fc_norm": False,
        "embed_requires_grad": False,
        "transformer_layer_config": transformer_layer_config(arch),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "accept_tolerance": 0.0,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "name_or_path": verifier_name_or_path,
                "architectures": verifier_architectures,
            },
        },
    }


def export_weights(
    state: Mapping[str, torch.Tensor],
    d2t: np.ndarray,
    t2d: np.ndarray,
    dtype: str,
    embed_tokens: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Draft weights under the checkpoint names, floats cast to ``dtype``; d2t/t2d as stored."""
    cast = EXPORT_DTYPES[dtype]
    out = {
        name: t.detach().to("cpu", cast).contiguous()
        for name, t in state.items()
        if name.startswith(("fc.", "input_norm.", "layers.", "norm.", "lm_head."))
    }
    if embed_tokens is not None:
        out["embed_tokens.weight"] = embed_tokens.detach().to("cpu", cast).contiguous()
    out["d2t"] = torch.from_numpy(np.ascontiguousarray(d2t, dtype=np.int64))
    out["t2d"] = torch.from_numpy(np.ascontiguousarray(t2d, dtype=np.bool_))
    return out


def write_checkpoint(
    directory: str | os.PathLike[str],
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    lineage: dict[str, Any],
    aux_layer_ids: list[int],
    training: dict[str, Any],
) -> Path:
    """Write the three files atomically; ``directory`` must not exist yet."""
    directory = Path(directory)
    expected_fp = fingerprint_vocab_map(weights["d2t"].numpy(), weights["t2d"].numpy())
    if lineage.get("vocab_map_fingerprint") != expected_fp:
        raise ValueError(
            f"export {directory}: lineage vocab_map_fingerprint {lineage.get('vocab_map_fingerprint')!r} "
            f"does not match the d2t/t2d being written ({expected_fp})"
        )
    with atomic_directory(directory) as tmp:
        write_safetensors(tmp / "model.safetensors", weights)
        write_json_atomic(tmp / "config.json", config)
        header = make_header(
            "draft_checkpoint", lineage, aux_layer_ids=list(aux_layer_ids), training=training
        )
        write_json_header(tmp / "eagle3.json", header)
    return directory
