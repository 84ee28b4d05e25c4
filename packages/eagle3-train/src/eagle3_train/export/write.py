"""Write the draft as a checkpoint that vLLM serves as is with ``method: eagle3``.

Directory (schemas/draft_checkpoint/v3.json): ``config.json`` — the speculators eagle3 layout
for the Llama-style draft, vLLM's native ``Eagle3DeepseekV2ForCausalLM`` layout for the MLA
draft (speculators' parser accepts only llama/qwen3 layers, and a ``deepseek_v3`` model_type
is rewritten to DeepSeek's MTP head by vLLM, so the MLA draft says ``deepseek_v2``),
``model.safetensors`` (weights under vLLM's names, plus ``d2t`` offsets and ``t2d`` where the
draft vocabulary is pruned: vLLM refuses a full-vocabulary draft that holds ``d2t``,
eagle3_schemas.layouts.draft_vocab) and ``eagle3.json`` (header + lineage). Written into a temporary directory and renamed, so a
crash never leaves something that looks like a finished checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_schemas.contract.header import make_header, write_json_header, write_safetensors
from eagle3_schemas.contract.lineage import fingerprint_vocab_map
from eagle3_schemas.io.atomic import atomic_directory, write_json_atomic
from eagle3_schemas.layouts.draft_layout import mla_eagle_config
from eagle3_schemas.layouts.draft_vocab import (
    checkpoint_vocab_map,
    serving_problems,
    stores_vocab_map,
)
from eagle3_train.config.run_config import Config
from eagle3_train.export.card import write_model_card
from eagle3_train.model.arch import DraftArch

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# speculators release whose eagle3 format (config.json layout, tensor names) this writes.
SPECULATORS_FORMAT_VERSION = "0.9.0"


def rope_block(arch: DraftArch) -> dict[str, Any]:
    """``rope_parameters``, ``rope_theta`` and ``rope_scaling`` that say one thing.

    The type is the one the draft trained with (``DraftArch.rope_type``: ``rope_type``, else
    the legacy ``type``). The legacy ``type`` key is not written: a reader that finds both
    with different values refuses the config (vLLM's ``patch_legacy_rope_type``), and every
    reader since transformers 4.45 takes ``rope_type``. ``rope_scaling`` is the same block
    without ``rope_theta`` (null for plain RoPE) for readers that predate ``rope_parameters``.
    """
    scaling = {
        k: v for k, v in (arch.rope_scaling or {}).items() if k not in ("type", "rope_theta")
    }
    rope_type = arch.rope_type
    parameters = {**scaling, "rope_type": rope_type, "rope_theta": arch.rope_theta}
    return {
        # transformers 5 reads rope_parameters; older readers rope_theta / rope_scaling.
        "rope_parameters": parameters,
        "rope_theta": arch.rope_theta,
        "rope_scaling": None if rope_type == "default" else {**scaling, "rope_type": rope_type},
    }


def transformer_layer_config(arch: DraftArch) -> dict[str, Any]:
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
        **rope_block(arch),
        "hidden_act": arch.hidden_act,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    }


def mla_draft_config(arch: DraftArch, aux_layer_ids: list[int]) -> dict[str, Any]:
    """config.json of the MLA draft in vLLM's native layout (Eagle3DeepseekV2ForCausalLM),
    which SGLang reads too: aux ids at the top level in vLLM's counting, under
    ``eagle_config`` in SGLang's (so vLLM's id 0, which SGLang cannot name, is refused)."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "hidden_act": arch.hidden_act,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_attention_heads,
        "q_lora_rank": arch.q_lora_rank,
        "kv_lora_rank": arch.kv_lora_rank,
        "qk_nope_head_dim": arch.qk_nope_head_dim,
        "qk_rope_head_dim": arch.qk_rope_head_dim,
        "v_head_dim": arch.v_head_dim,
        "rms_norm_eps": arch.rms_norm_eps,
        "max_position_embeddings": arch.max_position_embeddings,
        **rope_block(arch),
        "vocab_size": arch.target_vocab_size,
        "draft_vocab_size": arch.draft_vocab_size,
        "target_hidden_size": arch.hidden_size,
        # SGLang's MLA draft has the same class name and reads eagle_config's ids, in its
        # counting (vLLM's - 1); vLLM's target reads the top level, its draft eagle_config's
        # length (fc's size). One rule: eagle3_schemas.layouts.draft_layout.
        "eagle_config": mla_eagle_config(aux_layer_ids, "MLA draft config.json: "),
        "eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
        # Written out: the native route's default is False, speculators' True.
        "norm_before_residual": arch.norm_before_residual,
        "norm_output": arch.norm_output,
        "fc_norm": arch.fc_norm,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def draft_config(
    arch: DraftArch,
    aux_layer_ids: list[int],
    verifier_name_or_path: str | None,
    verifier_architectures: list[str],
    speculative_tokens: int,
) -> dict[str, Any]:
    """config.json: speculators' eagle3 layout (what vLLM's speculators parser reads), or
    vLLM's native MLA draft layout."""
    if arch.mla:
        return mla_draft_config(arch, aux_layer_ids)
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
        "fc_norm": arch.fc_norm,
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
    """Draft weights under the checkpoint names, floats cast to ``dtype``; d2t/t2d as the vocab
    map stores them, for a pruned vocabulary only (a full one's map is the identity, and vLLM
    has no parameter to load its ``d2t`` into)."""
    cast = EXPORT_DTYPES[dtype]
    out = {
        name: t.detach().to("cpu", cast).contiguous()
        for name, t in state.items()
        if name.startswith(("fc.", "fc_norm.", "input_norm.", "layers.", "norm.", "lm_head."))
    }
    if embed_tokens is not None:
        out["embed_tokens.weight"] = embed_tokens.detach().to("cpu", cast).contiguous()
    if stores_vocab_map(len(d2t), len(t2d)):
        out["d2t"] = torch.from_numpy(np.ascontiguousarray(d2t, dtype=np.int64))
        out["t2d"] = torch.from_numpy(np.ascontiguousarray(t2d, dtype=np.bool_))
    return out


def vocab_sizes(config: Mapping[str, Any]) -> tuple[int, int]:
    """(draft_vocab_size, target vocab_size) of a draft config.json, either layout."""
    layer = config.get("transformer_layer_config", config)
    return int(config["draft_vocab_size"]), int(layer["vocab_size"])


def write_checkpoint(
    directory: str | os.PathLike[str],
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    lineage: dict[str, Any],
    aux_layer_ids: list[int],
    training: dict[str, Any],
    run_config: Config | None = None,
) -> Path:
    """Write the three files (and the model card) atomically; ``directory`` must not exist.

    The card (card.py) is written from the run's config; without ``run_config`` the checkpoint
    has no card (``eagle3-train --card-only`` writes one later).
    """
    directory = Path(directory)
    v_draft, v_target = vocab_sizes(config)
    unserved = serving_problems(weights, v_draft, v_target)
    if unserved:
        raise ValueError(
            f"export {directory}: vLLM would not serve it:\n  "
            + "\n  ".join(f"tensor {name}: {why}" for name, why in unserved)
        )
    d2t, t2d = checkpoint_vocab_map(weights, lambda n: weights[n].numpy(), v_draft, v_target)
    expected_fp = fingerprint_vocab_map(d2t, t2d)
    if lineage.get("vocab_map_fingerprint") != expected_fp:
        raise ValueError(
            f"export {directory}: lineage vocab_map_fingerprint {lineage.get('vocab_map_fingerprint')!r} "
            f"does not match the vocabulary map being written ({expected_fp})"
        )
    with atomic_directory(directory) as tmp:
        write_safetensors(tmp / "model.safetensors", weights)
        write_json_atomic(tmp / "config.json", config)
        architecture = "llama" if "transformer_layer_config" in config else "mla"
        header = make_header(
            "draft_checkpoint",
            lineage,
            aux_layer_ids=list(aux_layer_ids),
            training=training,
            architecture=architecture,
        )
        write_json_header(tmp / "eagle3.json", header)
        if run_config is not None:
            write_model_card(tmp, run_config, served_as(run_config))
    return directory


def served_as(config: Config, draft_dir: Path | None = None) -> str:
    """What the card's `vllm serve` line names as the draft: the Hub id it will be published
    as, else its directory (the run's deliverable ``OUTPUT/draft`` for the trainer's exports)."""
    if config.export.card.repo_id:
        return config.export.card.repo_id
    return str(draft_dir if draft_dir is not None else Path(config.output_dir) / "draft")
