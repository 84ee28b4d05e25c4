"""What the extract stage needs to know about a target model directory, read from its files.

Only ``config.json`` and the safetensors headers are read (no transformers, no weights loaded),
so this works for a 1 TB target on a machine that could never load it, and inside vLLM's
environment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_schemas.layouts.target_config import text_config

# Where multimodal wrappers (Kimi-K2.5, Llama-4, Qwen-VL) keep the language model's tensors.
TEXT_PREFIXES = ("", "language_model.", "model.language_model.", "text_model.")


class TargetError(ValueError):
    """The target directory lacks something extraction needs."""


@dataclass(frozen=True)
class TargetInfo:
    path: Path
    architecture: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    torch_dtype: str | None
    max_position_embeddings: int | None = None
    # The checkpoint's quantization_config (top level or in text_config), None for plain weights.
    quantization: dict[str, Any] | None = None
    multimodal: bool = False  # a wrapper with a vision_config (Kimi-K2.5)
    # The decoder-layer shape a draft copies (heads, MLP width, RoPE), as the config states it.
    layer_shape: dict[str, Any] = field(default_factory=dict)

    def header_target(self) -> dict[str, Any]:
        """The ``target`` object of dataset.json (extra fields allowed by the schema).

        Beyond what extraction itself needs, it records the layer shape, so the trainer can
        size the draft from the dataset alone (no target directory restated in its config).
        """
        return {
            "architecture": self.architecture,
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            **(
                {"max_position_embeddings": self.max_position_embeddings}
                if self.max_position_embeddings
                else {}
            ),
            **self.layer_shape,
        }


# Keys of a decoder layer's shape that a draft layer copies from its target.
LAYER_SHAPE_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    # MLA targets (DeepSeek-V3, Kimi-K2.5): what an MLA draft copies.
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)


def read_target(path: Path) -> TargetInfo:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise TargetError(f"{path}: no config.json; expected a Hugging Face model directory")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    text = text_config(config)
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in text]
    if missing:
        raise TargetError(f"{config_path}: lacks {', '.join(missing)}")
    architectures = config.get("architectures") or [text.get("model_type", "unknown")]
    eps = text.get("rms_norm_eps", text.get("layer_norm_eps"))
    if eps is None:
        raise TargetError(
            f"{config_path}: no rms_norm_eps; the trainer needs it to apply the final norm exactly"
        )
    return TargetInfo(
        path=path,
        architecture=str(architectures[0]),
        model_type=str(text.get("model_type", config.get("model_type", "unknown"))),
        hidden_size=int(text["hidden_size"]),
        num_hidden_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
        rms_norm_eps=float(eps),
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        ),
        torch_dtype=config.get("dtype") or config.get("torch_dtype") or text.get("torch_dtype"),
        max_position_embeddings=text.get("max_position_embeddings"),
        quantization=config.get("quantization_config") or text.get("quantization_config"),
        multimodal="vision_config" in config,
        layer_shape={k: text[k] for k in LAYER_SHAPE_KEYS if text.get(k) is not None},
    )


def transformers_refusal(info: TargetInfo) -> str | None:
    """Why transformers cannot compute this target's states, or None. Compressed-tensors
    checkpoints (Kimi-K2.5's INT4 routed experts) need vLLM's kernels; transformers either fails
    on them or dequantizes a 1T-parameter model, so they are refused before a byte is loaded."""
    quant = info.quantization
    if not quant:
        return None
    method = quant.get("quant_method", "unknown")
    groups = quant.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values()]
    bits = sorted({w.get("num_bits") for w in weights if w.get("num_bits")})
    described = method + (f" int{'/'.join(map(str, bits))}" if bits else "")
    if weights and any(w.get("group_size") for w in weights):
        described += f" (group size {weights[0].get('group_size')}, {quant.get('format', '?')})"
    return (
        f"{info.path}/config.json: the weights are quantized ({described}); the transformers "
        "backend cannot run them — use --backend vllm, which loads them with its own kernels"
    )


def _tensor_index(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, over every shard of the checkpoint."""
    index: dict[str, Path] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TargetError(f"{path}: no *.safetensors weight files")
    for file in files:
        for name in read_safetensors(file).tensors:
            index[name] = file
    return index


def _find(index: dict[str, Path], suffix: str) -> str | None:
    for prefix in TEXT_PREFIXES:
        for base in ("model.", ""):
            name = f"{prefix}{base}{suffix}"
            if name in index:
                return name
    return None


def read_target_head(info: TargetInfo) -> dict[str, Any]:
    """norm.weight, lm_head.weight, embed_tokens.weight as torch tensors in a schema dtype.

    Reads only those three tensors from the checkpoint files. Tied targets store no lm_head:
    the embeddings are used for both (that is what tying means).
    """
    import torch
    from safetensors import safe_open

    index = _tensor_index(info.path)
    names = {
        "norm.weight": _find(index, "norm.weight"),
        "embed_tokens.weight": _find(index, "embed_tokens.weight"),
        "lm_head.weight": next(
            (n for n in (f"{p}lm_head.weight" for p in TEXT_PREFIXES) if n in index), None
        ),
    }
    if names["lm_head.weight"] is None and info.tie_word_embeddings:
        names["lm_head.weight"] = names["embed_tokens.weight"]
    missing = [k for k, v in names.items() if v is None]
    if missing:
        raise TargetError(
            f"{info.path}: cannot find {missing} among the checkpoint's tensors "
            f"(looked for prefixes {list(TEXT_PREFIXES)})"
        )
    out: dict[str, Any] = {}
    for key, name in names.items():
        assert name is not None
        with safe_open(str(index[name]), framework="pt") as f:
            tensor = f.get_tensor(name)
        if tensor.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            tensor = tensor.to(torch.bfloat16)
        out[key] = tensor.contiguous()
    h, v = info.hidden_size, info.vocab_size
    expected = {"norm.weight": (h,), "lm_head.weight": (v, h), "embed_tokens.weight": (v, h)}
    for key, shape in expected.items():
        if tuple(out[key].shape) != shape:
            raise TargetError(
                f"{info.path}: {names[key]} has shape {list(out[key].shape)}, expected "
                f"{list(shape)} from config.json (hidden_size={h}, vocab_size={v})"
            )
    return out


def head_bytes(info: TargetInfo) -> int:
    """Approximate size of target_head.safetensors (for the disk estimate)."""
    return int(np.int64(2) * (2 * info.vocab_size + 1) * info.hidden_size)
