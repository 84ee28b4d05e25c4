"""The multi-head latent attention of an MLA draft (vLLM's ``Eagle3DeepseekV2ForCausalLM``), as
vLLM runs it: its sizes, its rope (plain, DeepSeek YaRN, or YaRN without the softmax mscale) and
what vLLM 0.32 does differently from the config's face value (``notes``). ``draft_spec`` reads
the rest of the config into a ``DraftSpec`` holding this; ``DraftFormatError`` is defined here,
the lower of the two modules, and named by both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

MLA_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")


class DraftFormatError(ValueError):
    """The checkpoint is not an EAGLE-3 draft this evaluator (and vLLM) can run."""


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek YaRN's magnitude correction (vLLM ``yarn_get_mscale``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLASpec:
    """The multi-head latent attention of an ``Eagle3DeepseekV2ForCausalLM`` draft.

    ``rope_type`` is what vLLM runs: ``default`` or ``deepseek_yarn`` (any other type in the
    config is rewritten to it) or ``deepseek_llama_scaling`` (same rope, no softmax mscale;
    chosen when ``attention_factor`` is 1.0).
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """deepseek_v2.py DeepseekV2MLAAttention: qk_head_dim^-0.5 [* mscale^2 with yarn]."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "deepseek_yarn":
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_mscale(self) -> float:
        """Factor on cos/sin (DeepseekScalingRotaryEmbedding.mscale); 1 for plain rope."""
        if self.rope_type == "default":
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
            self.factor, self.mscale_all_dim
        )

    def inv_freq(self) -> Tensor:
        """[qk_rope_head_dim / 2] float32, as vLLM's rope cache is built."""
        dim, base = self.qk_rope_head_dim, self.rope_theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        if self.rope_type == "default":
            return 1.0 / pos_freqs

        # DeepseekScalingRotaryEmbedding._compute_inv_freq (rotary_embedding/common.py helpers).
        def correction_dim(rotations: float) -> float:
            return (
                dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor
        interpolation, extrapolation = 1.0 / (self.factor * pos_freqs), 1.0 / pos_freqs
        return interpolation * (1 - keep) + extrapolation * keep

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str, notes: list[str]) -> MLASpec:
        def need_int(key: str) -> int:
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise DraftFormatError(f"{where}: {key} must be a positive int, got {value!r}")
            return value

        if config.get("q_lora_rank") is None:
            # vLLM's hf_to_vllm_mapper renames kv_a_proj_with_mqa to fused_qkv_a_proj, which
            # only exists with a q_lora_rank: the checkpoint would not load.
            raise DraftFormatError(
                f"{where}: q_lora_rank is null; vLLM 0.32 cannot load an EAGLE-3 MLA draft "
                "without q_a_proj (its weight mapper needs fused_qkv_a_proj)"
            )
        rope = config.get("rope_parameters")
        legacy = config.get("rope_scaling")
        if not isinstance(rope, dict):
            rope = dict(legacy or {})
            rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        elif isinstance(legacy, dict):
            for key, value in legacy.items():
                key = "rope_type" if key == "type" else key
                if key in rope and rope[key] != value:
                    notes.append(
                        f"rope_scaling.{key} {value!r} differs from rope_parameters.{key} "
                        f"{rope[key]!r}; the rope_parameters value is used"
                    )
        rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
        theta = rope.get("rope_theta", config.get("rope_theta"))
        if theta is None:
            raise DraftFormatError(f"{where}: no rope_theta (rope_parameters.rope_theta)")
        dims = {
            key: need_int(key)
            for key in (
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            )
        }
        if dims["qk_rope_head_dim"] % 2:
            raise DraftFormatError(f"{where}: qk_rope_head_dim must be even")
        if (dims["kv_lora_rank"], dims["qk_rope_head_dim"]) != (512, 64):
            notes.append(
                f"kv_lora_rank {dims['kv_lora_rank']} + qk_rope_head_dim "
                f"{dims['qk_rope_head_dim']}: vLLM 0.32's MLA backends (CPU_MLA, FlashMLA) need "
                "512 + 64 (cache head size 576)"
            )
        if config.get("rope_interleave") is False:
            notes.append(
                "rope_interleave is false, but vLLM 0.32 always applies interleaved (GPT-J) rope "
                "to an MLA draft; it is evaluated (as served) with interleaved rope"
            )
        if rope_type == "default":
            return cls(**dims, rope_theta=float(theta))
        if rope_type not in ("yarn", "deepseek_yarn"):
            notes.append(
                f"rope type {rope_type!r}: vLLM 0.32 runs every non-default rope of an MLA draft "
                "as DeepSeek YaRN; evaluated as such"
            )
        if "factor" not in rope:
            raise DraftFormatError(f"{where}: rope type {rope_type!r} without factor")
        original = rope.get("original_max_position_embeddings")
        if original is None:
            original = config.get("max_position_embeddings")
            notes.append(
                "rope parameters have no original_max_position_embeddings; "
                f"max_position_embeddings {original} is used"
            )
        if original is None:
            raise DraftFormatError(f"{where}: no original_max_position_embeddings for yarn")
        return cls(
            **dims,
            rope_theta=float(theta),
            rope_type=(
                "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"
            ),
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(original),
            beta_fast=float(rope.get("beta_fast", 32)),
            beta_slow=float(rope.get("beta_slow", 1)),
            mscale=float(rope.get("mscale", 1)),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        )
