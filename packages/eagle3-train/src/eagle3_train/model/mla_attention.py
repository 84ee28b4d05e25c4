"""DeepSeek multi-head latent attention, as the MLA draft (vLLM's
``Eagle3DeepseekV2ForCausalLM``) serves it: interleaved RoPE on the rope slice, the softmax
scale with YaRN's mscale."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from eagle3_train.model.arch import DraftArch
from eagle3_train.model.layers import LayerCache, RMSNorm, apply_rope, ttt_attend
from eagle3_train.model.shift import Alignment


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-J RoPE (vLLM's DeepSeek convention: pairs x[2i], x[2i+1] at frequency i), returned
    with each pair's halves regrouped [even | odd]: q and k regroup alike, so q·k is vLLM's."""
    *lead, d = x.shape
    x = x.reshape(*lead, d // 2, 2).transpose(-1, -2).reshape(*lead, d)
    return apply_rope(x, cos, sin)


def mla_softmax_scale(arch: DraftArch) -> float:
    """(nope + rope)^-0.5, times mscale² under YaRN with mscale_all_dim (DeepSeek's)."""
    scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    scaling = arch.rope_scaling or {}
    mscale_all_dim = float(scaling.get("mscale_all_dim") or 0.0)
    if arch.rope_type != "default" and mscale_all_dim:
        mscale = 0.1 * mscale_all_dim * math.log(float(scaling["factor"])) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """DeepSeek multi-head latent attention as vLLM's MLA draft computes it (expanded form:
    vLLM's absorbed decode is the same product). Names are vLLM's checkpoint names."""

    def __init__(self, arch: DraftArch, in_features: int) -> None:
        super().__init__()
        self.nh = arch.num_attention_heads
        self.nope, self.rope, self.dv = (
            arch.qk_nope_head_dim,
            arch.qk_rope_head_dim,
            arch.v_head_dim,
        )
        self.kv_lora = arch.kv_lora_rank
        qk = self.nope + self.rope
        self.q_a_proj = nn.Linear(in_features, arch.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(arch.q_lora_rank, arch.rms_norm_eps)
        self.q_b_proj = nn.Linear(arch.q_lora_rank, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(in_features, self.kv_lora + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora, arch.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora, self.nh * (self.nope + self.dv), bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, arch.hidden_size, bias=False)
        self.impl, self.chunk = arch.attention, arch.attention_chunk
        self.scale = mla_softmax_scale(arch)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache, docs: Alignment
    ) -> Tensor:
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(T, self.nh, self.nope + self.rope).transpose(0, 1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c_kv))
        k_nope, v = (
            kv.view(T, self.nh, self.nope + self.dv)
            .transpose(0, 1)
            .split([self.nope, self.dv], dim=-1)
        )
        q_pe = apply_rope_interleaved(q[..., self.nope :], cos, sin)
        k_pe = apply_rope_interleaved(k_pe.unsqueeze(0), cos, sin).expand(self.nh, T, self.rope)
        q = torch.cat([q[..., : self.nope], q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe], dim=-1)
        out = ttt_attend(q, k, v, cache, docs, self.impl, self.chunk, self.scale)
        return self.o_proj(out.transpose(0, 1).reshape(T, self.nh * self.dv))
