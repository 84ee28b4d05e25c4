"""Llama attention, as the Llama-style EAGLE-3 layer (vLLM's ``LlamaForCausalLMEagle3``) serves it."""

from __future__ import annotations

from torch import Tensor, nn

from eagle3_train.model.arch import DraftArch
from eagle3_train.model.layers import LayerCache, apply_rope, ttt_attend
from eagle3_train.model.shift import Alignment


class Attention(nn.Module):
    def __init__(self, arch: DraftArch, in_features: int) -> None:
        super().__init__()
        self.nh, self.nkv, self.d = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        self.q_proj = nn.Linear(in_features, self.nh * self.d, bias=False)
        self.k_proj = nn.Linear(in_features, self.nkv * self.d, bias=False)
        self.v_proj = nn.Linear(in_features, self.nkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.nh * self.d, arch.hidden_size, bias=False)
        self.impl, self.chunk = arch.attention, arch.attention_chunk

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache, docs: Alignment
    ) -> Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.nh, self.d).transpose(0, 1)
        k = self.k_proj(x).view(T, self.nkv, self.d).transpose(0, 1)
        v = self.v_proj(x).view(T, self.nkv, self.d).transpose(0, 1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = ttt_attend(q, k, v, cache, docs, self.impl, self.chunk)
        return self.o_proj(out.transpose(0, 1).reshape(T, self.nh * self.d))
