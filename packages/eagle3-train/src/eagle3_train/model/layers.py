"""Building blocks of both draft layers: RMSNorm, RoPE, the MLP, and the TTT attention step
(this step's keys cached, the attention path chosen: attention.py, flash_attention.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3_train.model.arch import DraftArch
from eagle3_train.model.attention import chunked_ttt_attention, dense_ttt_attention
from eagle3_train.model.flash_attention import flash_ttt_attention, resolve_attention
from eagle3_train.model.shift import Alignment


class RMSNorm(nn.Module):
    """Llama RMSNorm: computed in float32, weight applied in the input dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


class Rotary(nn.Module):
    """Llama RoPE; non-default types use transformers' ROPE_INIT_FUNCTIONS (e.g. llama3)."""

    def __init__(self, arch: DraftArch) -> None:
        super().__init__()
        scaling = dict(arch.rope_scaling or {})
        rope_type = arch.rope_type
        if rope_type == "default":
            d = arch.rope_dim
            inv_freq = 1.0 / (
                arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
            )
            self.attention_scaling = 1.0
        else:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            cfg = LlamaConfig(
                hidden_size=arch.hidden_size,
                num_attention_heads=arch.num_attention_heads,
                head_dim=arch.rope_dim,
                max_position_embeddings=arch.max_position_embeddings,
                rope_parameters={**scaling, "rope_theta": arch.rope_theta},
            )
            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (
            emb.sin() * self.attention_scaling
        ).to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [heads, T, d]; cos/sin [T, d]."""
    return x * cos + _rotate_half(x) * sin


class LayerCache:
    """Keys/values of one layer across the TTT steps of one batch."""

    def __init__(self) -> None:
        self.k0: Tensor | None = None
        self.v0: Tensor | None = None
        self.kd: list[Tensor] = []
        self.vd: list[Tensor] = []


@torch.compiler.disable  # opaque to a compiled layer: its own kernels and autograd
def ttt_attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cache: LayerCache,
    docs: Alignment,
    impl: str,
    chunk: int,
    scale: float | None = None,
) -> Tensor:
    """Cache this TTT step's keys/values, then attend over step 0's and this slot's own.

    Under autocast every step attends in autocast's dtype: after step 0 the fed-back state
    comes through a float32 residual, which would otherwise upcast q and k (and send
    ``auto`` to the float32 reference path for all later steps)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if cache.k0 is None:
        cache.k0, cache.v0 = k, v
    else:
        cache.kd.append(k)
        cache.vd.append(v)
    assert cache.k0 is not None and cache.v0 is not None
    kd = torch.stack(cache.kd) if cache.kd else k.new_zeros((0, *k.shape))
    vd = torch.stack(cache.vd) if cache.vd else v.new_zeros((0, *v.shape))
    impl = resolve_attention(impl, q.device, q.dtype)
    if impl == "flash":
        k0, v0 = cache.k0, cache.v0
        return flash_ttt_attention(q, k0, v0, kd, vd, docs.cu_seqlens, docs.max_doc_len, scale)
    if impl == "sdpa":
        return dense_ttt_attention(q, cache.k0, cache.v0, kd, vd, docs.doc_start, scale)
    return chunked_ttt_attention(q, cache.k0, cache.v0, kd, vd, docs.doc_start, chunk, scale)


class MLP(nn.Module):
    def __init__(self, arch: DraftArch) -> None:
        super().__init__()
        if arch.hidden_act != "silu":
            raise ValueError(f"hidden_act {arch.hidden_act!r}: only 'silu' (Llama) is supported")
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
