"""Checks of the draft checkpoint: layer ids, the vocabulary map (stored only for a pruned
vocabulary, fingerprinted), the variant's attention tensors, finite weights; and the shape
symbols of both config.json layouts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.contract.checks.common import (
    d2t_offset_violations,
    file_name,
    named,
    t2d_violations,
)
from eagle3_schemas.io.fingerprint import fingerprint_vocab_map
from eagle3_schemas.io.safetensors_format import nonfinite_count
from eagle3_schemas.layouts.draft_vocab import (
    checkpoint_vocab_map,
    serving_problems,
    stores_vocab_map,
)


def symbols(art: Artifact) -> dict[str, int]:
    """Shape symbols fixed by config.json (either layout), before any tensor is read."""
    config = art.json(art.root / "config.json")
    if "transformer_layer_config" not in config:
        return mla_draft_symbols(config)
    layer = config["transformer_layer_config"]
    head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
    return {
        **_draft_symbols(config, layer),
        "q_dim": layer["num_attention_heads"] * head_dim,
        "kv_dim": layer["num_key_value_heads"] * head_dim,
        "o_dim": layer["num_attention_heads"] * head_dim,
    }


def _draft_symbols(config: dict[str, Any], layer: dict[str, Any]) -> dict[str, int]:
    """The symbols both draft variants share; ``layer`` holds the decoder layer's sizes (the
    Llama layout's transformer_layer_config, the MLA layout's top level)."""
    hidden = layer["hidden_size"]
    return {
        "H": hidden,
        "two_H": 2 * hidden,
        "V_draft": config["draft_vocab_size"],
        "V_target": layer["vocab_size"],
        "n_aux_H": len(config["eagle_aux_hidden_state_layer_ids"])
        * (config.get("target_hidden_size") or hidden),
        "I": layer["intermediate_size"],
    }


def mla_draft_symbols(config: dict[str, Any]) -> dict[str, int]:
    """Shape symbols of an MLA draft's native config.json (draft_checkpoint v2, variant mla)."""
    heads = config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    return {
        **_draft_symbols(config, config),
        "q_lora": config["q_lora_rank"],
        "q_b_dim": heads * (nope + rope),
        "kv_lora": config["kv_lora_rank"],
        "kv_a_dim": config["kv_lora_rank"] + rope,
        "kv_b_dim": heads * (nope + v),
        "o_dim": heads * v,
    }


def layer_ids(art: Artifact) -> list[Violation]:
    config_ids = art.json(art.root / "config.json")["eagle_aux_hidden_state_layer_ids"]
    header_ids = art.header.fields["aux_layer_ids"]
    if config_ids == header_ids:
        return []
    message = f"{config_ids} but eagle3.json aux_layer_ids is {header_ids}"
    return [
        Violation(art.rel(art.root / "config.json"), "eagle_aux_hidden_state_layer_ids", message)
    ]


def _draft_vocab_sizes(art: Artifact) -> tuple[int, int]:
    """(V_draft, V_target) as config.json states them, either layout."""
    sizes = symbols(art)
    return int(sizes["V_draft"]), int(sizes["V_target"])


def _draft_vocab_map(art: Artifact) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's (d2t, t2d): stored, or the identity of a full vocabulary that stores
    none (draft_checkpoint v3). Where d2t is missing from a pruned draft, the identity stands
    in so the other checks still run; vocab_map_tensors names the missing tensor."""
    st = art.safetensors(art.path("weights"))
    v_draft, v_target = _draft_vocab_sizes(art)
    if "d2t" not in st.tensors and stores_vocab_map(v_draft, v_target):
        t2d = np.zeros(v_target, dtype=np.bool_)
        t2d[:v_draft] = True  # what vLLM would serve: draft id i as target id i
        return np.zeros(v_draft, dtype=np.int64), t2d
    return checkpoint_vocab_map(st.tensors, st.array, v_draft, v_target)


def d2t_offsets(art: Artifact) -> list[Violation]:
    d2t, t2d = _draft_vocab_map(art)
    return d2t_offset_violations(file_name(art, "weights"), d2t, len(t2d))


def t2d_matches_d2t(art: Artifact) -> list[Violation]:
    d2t, t2d = _draft_vocab_map(art)
    return t2d_violations(file_name(art, "weights"), d2t, t2d)


def vocab_map_fingerprint(art: Artifact) -> list[Violation]:
    stored = fingerprint_vocab_map(*_draft_vocab_map(art))
    recorded = art.header.lineage["vocab_map_fingerprint"]
    if stored == recorded:
        return []
    message = f"{recorded} but the checkpoint's d2t/t2d fingerprint is {stored}"
    return [
        Violation(art.rel(art.path("lineage")), "header.lineage.vocab_map_fingerprint", message)
    ]


def vocab_map_tensors(art: Artifact) -> list[Violation]:
    names = art.safetensors(art.path("weights")).tensors
    v_draft, v_target = _draft_vocab_sizes(art)
    where = file_name(art, "weights")
    out = [
        Violation(where, f"tensor {name}", why)
        for name, why in serving_problems(names, v_draft, v_target)
    ]
    if not stores_vocab_map(v_draft, v_target) and "t2d" in names:
        message = (
            f"stored in a full-vocabulary draft (draft_vocab_size = vocab_size = {v_target}): "
            "its map is the identity, stored by neither d2t nor t2d"
        )
        out.append(Violation(where, "tensor t2d", message))
    elif stores_vocab_map(v_draft, v_target) and "t2d" not in names:
        out.append(Violation(where, "tensor t2d", "missing beside d2t in a pruned draft"))
    return out


VARIANT_TENSORS = {
    "llama": ("q_proj", "k_proj", "v_proj"),
    "mla": (
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
    ),
}


def variant_tensors(art: Artifact) -> list[Violation]:
    variant = art.header.fields["architecture"]
    config = art.json(art.root / "config.json")
    where = file_name(art, "weights")
    out = []
    if ("transformer_layer_config" in config) != (variant == "llama"):
        message = (
            f"eagle3.json architecture {variant!r} but config.json is in the other variant's layout"
        )
        out.append(Violation(file_name(art, "config"), "(layout)", message))
    names = set(art.safetensors(art.path("weights")).tensors)
    for kind, parts in VARIANT_TENSORS.items():
        for part in parts:
            name = f"layers.0.self_attn.{part}.weight"
            if kind == variant and name not in names:
                message = f"missing: the {variant} attention needs it"
                out.append(Violation(where, f"tensor {name}", message))
            elif kind != variant and name in names:
                message = f"a {kind} tensor in a {variant} draft"
                out.append(Violation(where, f"tensor {name}", message))
    return out


def finite(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("weights"))
    return [
        Violation(art.rel(art.path("weights")), f"tensor {name}", f"{bad} NaN/Inf values")
        for name, info in st.tensors.items()
        if (bad := nonfinite_count(st.array(name), info.dtype))
    ]


CHECKS = named(
    layer_ids,
    d2t_offsets,
    variant_tensors,
    t2d_matches_d2t,
    vocab_map_tensors,
    vocab_map_fingerprint,
    finite,
)
