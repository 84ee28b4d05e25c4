"""The shape of the draft network: everything its config.json describes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The draft's norm options (draft.* in the config, keys of its config.json).
NORM_OPTIONS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


@dataclass
class DraftArch:
    """Everything that shapes the draft network (what config.json describes)."""

    hidden_size: int
    num_aux: int
    target_vocab_size: int
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    target_rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None = None
    num_layers: int = 1
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    hidden_act: str = "silu"
    architecture: str = "llama"  # "llama" | "mla"
    # MLA only
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    attention: str = "auto"  # auto | chunked | flash | sdpa (attention.py)
    attention_chunk: int = 512
    loss_chunk: int = 1024

    @property
    def mla(self) -> bool:
        return self.architecture == "mla"

    @property
    def rope_dim(self) -> int:
        """The dimension RoPE rotates: a whole Llama head, MLA's rope slice."""
        return self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))
