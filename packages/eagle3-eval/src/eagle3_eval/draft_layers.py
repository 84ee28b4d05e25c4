"""The layers of eval's draft forward, as vLLM computes them: RMSNorm, both ropes (Neox and
GPT-J interleaved), grouped-query attention, the Llama-style layer and the MLA layer with its
rope. ``draft.py`` states the semantics they follow and composes them into the draft; like it,
this shares no code with eagle3-train on purpose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from eagle3_eval.draft_spec import ATTENTION, MLP, DraftSpec
from eagle3_eval.mla_spec import MLA_ATTENTION, MLA_NORMS, MLASpec


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: normalised in float32, then scaled by the weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox-style rope (Llama's): x [n, heads, d], cos/sin [n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-J-style rope (vLLM ``is_neox_style=False``): pairs (x[2i], x[2i+1]) rotate by angle i.

    x [n, heads, d], cos/sin [n, d/2]; the output keeps the interleaved layout.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Softmax attention of q [n_q, heads, d] over k [n_k, kv_heads, d], v [n_k, kv_heads, d_v]
    where mask is True.

    mask [n_q, n_k] bool. Grouped-query heads share keys; scores run in float32 and are scaled
    by ``scale`` (default d^-0.5).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float())
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


@dataclass
class KV:
    """Keys and values of some draft rows for one layer: [n, kv_heads, d] each."""

    k: Tensor
    v: Tensor

    @staticmethod
    def cat(parts: list[KV]) -> KV:
        return KV(torch.cat([p.k for p in parts]), torch.cat([p.v for p in parts]))

    def __len__(self) -> int:
        return self.k.shape[0]


@dataclass
class DraftStep:
    """Output of one draft forward over n rows."""

    logits: Tensor  # [n, V_draft]
    chain_hidden: Tensor  # [n, H]: what the next chain step is fed
    kv: list[KV]  # per layer, the new rows' keys and values


class DecoderLayer(nn.Module):
    """What every draft layer shares: the layer input (``layer_input``), residuals, the
    post-attention norm and the dense SiLU MLP. Subclasses build the attention and name it."""

    ATTENTION_NAMES: tuple[str, ...] = ()
    hidden_norm_in_every_layer = False

    def __init__(self, spec: DraftSpec, index: int) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.spec, self.index = spec, index
        self.gate_proj = nn.Linear(h, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if index == 0 or self.hidden_norm_in_every_layer:
            self.hidden_norm = RMSNorm(h, eps)
        self.act = ACT2FN[spec.hidden_act]

    def checkpoint_modules(self) -> dict[str, nn.Module]:
        prefix = f"layers.{self.index}."
        out: dict[str, nn.Module] = {}
        for name in self.ATTENTION_NAMES:
            out[f"{prefix}self_attn.{name}"] = getattr(self, name)
        for name in MLP:
            out[f"{prefix}mlp.{name}"] = getattr(self, name)
        for name in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            if hasattr(self, name):
                out[prefix + name] = getattr(self, name)
        return out

    def attention(
        self, x: Tensor, rope: tuple[Tensor, Tensor], past: KV | None, mask: Tensor
    ) -> tuple[Tensor, KV]:
        """Attention of x [n, 2H or H] -> (o_proj output [n, H], these rows' KV)."""
        raise NotImplementedError

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        rope: tuple[Tensor, Tensor],
        past: KV | None,
        mask: Tensor,
    ) -> tuple[Tensor, Tensor, KV]:
        """Returns (mlp output, residual, this layer's new KV) — vLLM keeps the two apart."""
        x, residual = layer_input(self, embeds, hidden, residual)
        attention, new = self.attention(x, rope, past, mask)
        residual = residual + attention
        x = self.post_attention_layernorm(residual)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)), residual, new


class DraftLayer(DecoderLayer):
    """One Llama decoder layer; layer 0 reads cat(embeds, hidden) [2H]."""

    ATTENTION_NAMES = ATTENTION

    def __init__(self, spec: DraftSpec, index: int) -> None:
        super().__init__(spec, index)
        h = spec.hidden_size
        q_dim = spec.num_attention_heads * spec.head_dim
        kv_dim = spec.num_key_value_heads * spec.head_dim
        qkv_in = 2 * h if index == 0 else h
        self.q_proj = nn.Linear(qkv_in, q_dim, bias=spec.attention_bias)
        self.k_proj = nn.Linear(qkv_in, kv_dim, bias=spec.attention_bias)
        self.v_proj = nn.Linear(qkv_in, kv_dim, bias=spec.attention_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=False)

    def attention(
        self, x: Tensor, rope: tuple[Tensor, Tensor], past: KV | None, mask: Tensor
    ) -> tuple[Tensor, KV]:
        spec = self.spec
        n = x.shape[0]
        cos, sin = rope
        q = rotate(self.q_proj(x).view(n, spec.num_attention_heads, spec.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(n, spec.num_key_value_heads, spec.head_dim), cos, sin)
        v = self.v_proj(x).view(n, spec.num_key_value_heads, spec.head_dim)
        new = KV(k, v)
        keys = new if past is None else KV.cat([past, new])
        return self.o_proj(attend(q, keys.k, keys.v, mask).flatten(-2)), new


def layer_input(
    layer: nn.Module, embeds: Tensor, hidden: Tensor, residual: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The attention input and the residual of a draft layer (llama_eagle3.py and
    deepseek_eagle3.py alike): layer 0 reads cat(input_layernorm(embeds), hidden_norm(h)) [2H]
    with the residual h (normed with ``norm_before_residual``); later layers add the previous
    layer's residual and apply input_layernorm."""
    if layer.index == 0:
        embeds = layer.input_layernorm(embeds)
        if layer.spec.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = layer.hidden_norm(hidden)
        return torch.cat([embeds, hidden], dim=-1), residual
    assert residual is not None
    residual = hidden + residual
    return layer.input_layernorm(residual), residual


class MLADraftLayer(DecoderLayer):
    """One layer of vLLM's DeepseekV2Eagle3Model: MLA attention, dense SiLU MLP.

    Layer 0's ``q_a_proj`` and ``kv_a_proj_with_mqa`` read cat(embeds, hidden) [2H]. The KV
    rows are kept expanded (keys [n, heads, nope + rope], values [n, heads, v_head_dim]);
    vLLM caches the latent (c_kv, k_pe) and absorbs kv_b_proj, which is the same product.
    """

    ATTENTION_NAMES = MLA_ATTENTION + MLA_NORMS
    hidden_norm_in_every_layer = True  # as vLLM builds it; only layer 0 uses it

    def __init__(self, spec: DraftSpec, index: int) -> None:
        super().__init__(spec, index)
        mla = spec.mla
        assert mla is not None
        h, heads, eps = spec.hidden_size, spec.num_attention_heads, spec.rms_norm_eps
        x_in = 2 * h if index == 0 else h
        self.mla = mla
        self.q_a_proj = nn.Linear(x_in, mla.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            x_in, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=False)

    def attention(
        self, x: Tensor, rope: tuple[Tensor, Tensor], past: KV | None, mask: Tensor
    ) -> tuple[Tensor, KV]:
        """MLA of x [n, 2H or H] -> (o_proj output [n, H], these rows' KV)."""
        mla, heads = self.mla, self.spec.num_attention_heads
        nope, rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        n = x.shape[0]
        cos, sin = rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(n, heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([nope, rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rotate_interleaved(q_pe, cos, sin)
        k_pe = rotate_interleaved(k_pe[:, None, :], cos, sin)  # one head, shared by all
        k_nope, v = (
            self.kv_b_proj(c_kv)
            .view(n, heads, nope + mla.v_head_dim)
            .split([nope, mla.v_head_dim], dim=-1)
        )
        new = KV(torch.cat([k_nope, k_pe.expand(n, heads, rope_dim)], dim=-1), v.contiguous())
        keys = new if past is None else KV.cat([past, new])
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = attend(q, keys.k, keys.v, mask, mla.softmax_scale)
        return self.o_proj(out.flatten(-2)), new


class MLARotaryEmbedding(nn.Module):
    """cos/sin [1, n, qk_rope_head_dim / 2] of vLLM's MLA rope (plain or DeepSeek YaRN).

    Computed in float32 from the spec at every call, so casting the draft to another dtype
    does not round the frequencies.
    """

    def __init__(self, mla: MLASpec) -> None:
        super().__init__()
        self.mla = mla

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.mla.inv_freq().to(x.device)
        freqs = position_ids[..., None].float() * inv_freq
        mscale = self.mla.rope_mscale
        return freqs.cos() * mscale, freqs.sin() * mscale
