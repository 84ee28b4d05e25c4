"""The EAGLE-3 draft network (Llama-style or MLA), its training-time-test unroll and loss.

No I/O and no distributed code. Parameter names are the speculators / vLLM checkpoint names
(``fc``, ``layers.N.*``, ``norm``, ``lm_head``), so export is a rename-free copy.

Architecture (what vLLM's ``Eagle3LlamaForCausalLM`` computes at serving time):

- ``fc``: concat of the ``n_aux`` aux hidden states [n_aux·H] -> H (``norm_before_fc``
  first applies one RMSNorm over the concatenation; its weight is ``input_norm.weight``);
- layer 0: ``input_layernorm(embed(token))`` and ``hidden_norm(hidden)`` are concatenated
  to 2H for q/k/v; the residual is the raw hidden state, or the normed one with
  ``norm_before_residual``; then Llama attention + MLP with residuals;
- layers 1..: plain Llama decoder layers (H inputs);
- ``norm`` then ``lm_head`` over the draft vocabulary. The state fed to the next TTT step is
  the pre-norm output, or the normed one with ``norm_output``.

The MLA draft (``architecture="mla"``, vLLM's ``Eagle3DeepseekV2ForCausalLM``) is the same
network with DeepSeek's multi-head latent attention in place of Llama attention: layer 0's
q_a_proj and kv_a_proj_with_mqa read the 2H concatenation; RoPE is interleaved (GPT-J pairs)
on the rope slice only, one k_pe shared by all heads; the softmax scale is
(nope + rope)^-0.5, times mscale² under YaRN; the MLP is dense.

Frozen, taken from the target (never trained, never part of the resumable state):
``embed_tokens`` [V_target, H], ``verifier_norm`` [H] and ``verifier_lm_head``
[V_draft, H] — the target's lm_head rows of the draft vocabulary only, so the target's
full-vocabulary logits are never formed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3_train.attention import chunked_ttt_attention, dense_ttt_attention
from eagle3_train.config import ObjectiveConfig
from eagle3_train.flash_attention import flash_ttt_attention, resolve_attention
from eagle3_train.loss import (
    LOSS_EPS,
    Alignment,
    TargetTopK,
    align,
    fused_linear_kl,
    mm_f32,
    step_accuracy,
)

PLAIN_TTT = ObjectiveConfig(topk_weight=0.0)


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


class LayerCache:
    """Keys/values of one layer across the TTT steps of one batch."""

    def __init__(self) -> None:
        self.k0: Tensor | None = None
        self.v0: Tensor | None = None
        self.kd: list[Tensor] = []
        self.vd: list[Tensor] = []


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


class DecoderLayer(nn.Module):
    """Layer 0 takes concat(embed, hidden) [2H]; later layers are plain Llama layers."""

    def __init__(self, arch: DraftArch, index: int) -> None:
        super().__init__()
        self.first = index == 0
        self.norm_before_residual = arch.norm_before_residual
        H = arch.hidden_size
        attention = MLAAttention if arch.mla else Attention
        self.self_attn = attention(arch, 2 * H if self.first else H)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(H, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, arch.rms_norm_eps)
        if self.first:
            self.hidden_norm = RMSNorm(H, arch.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        embeds: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        cache: LayerCache,
        docs: Alignment,
    ) -> Tensor:
        if self.first:
            assert embeds is not None
            hidden = self.hidden_norm(x)
            residual = hidden if self.norm_before_residual else x
            attn_in = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        else:
            residual = x
            attn_in = self.input_layernorm(x)
        x = residual + self.self_attn(attn_in, cos, sin, cache, docs)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftLMHead(nn.Module):
    """The draft LM head; its forward is the fused LM-head + KL so ZeRO-3 gathers the weight."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(
        self,
        h: Tensor,
        target_logp: Tensor | None = None,
        row_weights: Tensor | None = None,
        chunk: int = 1024,
        top: TargetTopK | None = None,
    ) -> tuple[Tensor, ...]:
        """(logits, argmax) without a target; with one, ``fused_linear_kl``'s (loss, KL, argmax)."""
        if target_logp is None or row_weights is None:
            logits = h @ self.weight.T
            return logits, logits.argmax(-1)
        return fused_linear_kl(h, self.weight, target_logp, row_weights, chunk, top=top)


class Eagle3Draft(nn.Module):
    def __init__(self, arch: DraftArch) -> None:
        super().__init__()
        self.arch = arch
        H = arch.hidden_size
        if not arch.mla and arch.num_attention_heads % arch.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {arch.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {arch.num_key_value_heads}"
            )
        if arch.norm_before_fc:
            self.input_norm = RMSNorm(arch.num_aux * H, arch.rms_norm_eps)
        self.fc = nn.Linear(arch.num_aux * H, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(H, arch.rms_norm_eps)
        self.lm_head = DraftLMHead(H, arch.draft_vocab_size)
        self.rotary = Rotary(arch)
        # Frozen target pieces: buffers, so no optimizer, DDP bucket or ZeRO partition sees
        # them and no checkpoint stores them (they come from target_head.safetensors).
        self.register_buffer(
            "embed_tokens", torch.zeros(arch.target_vocab_size, H), persistent=False
        )
        self.register_buffer("verifier_norm", torch.ones(H), persistent=False)
        self.register_buffer(
            "verifier_lm_head", torch.zeros(arch.draft_vocab_size, H), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama-style init (normal, std 0.02; norms at one)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.lm_head.weight, std=0.02)

    @torch.no_grad()
    def load_target_head(
        self,
        embed_tokens: Tensor,
        norm_weight: Tensor,
        lm_head_draft_rows: Tensor,
        init_lm_head: bool = True,
    ) -> None:
        """Install the frozen target weights; the draft lm_head starts at the target's rows."""
        self.embed_tokens.copy_(embed_tokens)
        self.verifier_norm.copy_(norm_weight)
        self.verifier_lm_head.copy_(lm_head_draft_rows)
        if init_lm_head:
            self.lm_head.weight.copy_(lm_head_draft_rows)

    @torch.no_grad()
    def store_frozen_as(self, dtype: torch.dtype) -> None:
        """Keep the frozen target embedding and LM-head rows in ``dtype`` (bf16 under bf16
        training: the target's own dtype, half the memory; the norm weight stays float32)."""
        self.embed_tokens = self.embed_tokens.to(dtype)
        self.verifier_lm_head = self.verifier_lm_head.to(dtype)

    @torch.no_grad()
    def target_log_probs(self, last_hidden: Tensor) -> Tensor:
        """log softmax over the draft vocabulary of lm_head_rows(norm(last)), float32 (also
        under autocast: the target distribution is the reference). With bf16 head rows the
        GEMM takes bf16 inputs with a float32 result, as the target computes its logits."""
        with torch.autocast(last_hidden.device.type, enabled=False):
            normed = rms_norm(last_hidden, self.verifier_norm, self.arch.target_rms_norm_eps)
            head = self.verifier_lm_head
            logits = (
                mm_f32(normed.to(head.dtype), head.T)
                if head.dtype != normed.dtype
                else normed @ head.T
            )
            return torch.log_softmax(logits.float(), dim=-1)

    def forward(
        self,
        aux_hidden: Tensor,  # [T, n_aux, H] (any float dtype)
        last_hidden: Tensor,  # [T, H] target layer N, pre-norm
        input_ids: Tensor,  # [T] long
        loss_mask: Tensor,  # [T] bool/uint8
        cu_seqlens: Tensor,  # [n+1] long
        ttt_steps: int,
        ttt_step_loss_decay: float = 1.0,
        alignment: Alignment | None = None,
        objective: ObjectiveConfig | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(loss, stats): stats [ttt_steps, NUM_STATS] float64 holds, per step, the decayed
        step loss, the KL sum, scored slots, fully-correct slots and the conditional
        denominator (``loss.unpack_stats`` names them). Plain
        tensors, so DDP/DeepSpeed hooks see them.

        ``alignment``: ``loss.align`` of this batch computed on the host and moved here (the
        trainer does so); without it, it is computed here, reading counts back to the host.
        ``objective``: train.objective; None = plain EAGLE-3 TTT (what speculators computes;
        the trainer passes the config's)."""
        T = input_ids.shape[0]
        obj = objective or PLAIN_TTT
        al = alignment or align(input_ids, loss_mask, cu_seqlens, ttt_steps)
        target_logp = self.target_log_probs(last_hidden)
        target_ids = target_logp.argmax(-1)
        target_top = TargetTopK.of(target_logp, obj.topk, obj.topk_weight)
        pdtype = self.fc.weight.dtype
        x = aux_hidden.reshape(T, -1).to(pdtype)
        if self.arch.norm_before_fc:
            x = self.input_norm(x)
        hidden = self.fc(x)
        caches = [LayerCache() for _ in self.layers]
        prev_correct = al.valid[0]
        device = hidden.device.type  # RoPE in the dtype q and k are computed in
        rope_dtype = (
            torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        )
        loss = hidden.new_zeros((), dtype=torch.float32)
        rows: list[Tensor] = []
        for k in range(ttt_steps):
            embeds = F.embedding(al.step_tokens[k], self.embed_tokens).to(hidden.dtype)
            cos, sin = self.rotary(al.positions + k, rope_dtype)
            x = hidden
            for i, layer in enumerate(self.layers):
                x = layer(x, embeds if i == 0 else None, cos, sin, caches[i], al)
            normed = self.norm(x)
            hidden = normed if self.arch.norm_output else x
            # Draft logits only for the rows that count (scored, or in the accuracy chain);
            # each is trained toward the target's row t+1+k.
            loss_rows, valid = al.loss_rows[k], al.valid[k]
            decay = ttt_step_loss_decay**k
            denominator = al.num_scored[k] + LOSS_EPS
            row_w = valid[loss_rows].float() * (decay / denominator)
            step_loss, step_kl, preds = self.lm_head(
                normed[loss_rows],
                target_logp[loss_rows + 1 + k],
                row_w,
                self.arch.loss_chunk,
                target_top[loss_rows + 1 + k] if target_top else None,
            )
            loss = loss + step_loss
            with torch.no_grad():
                correct = torch.zeros(T, dtype=torch.bool, device=preds.device)
                correct[loss_rows] = preds == target_ids[loss_rows + 1 + k]
                full_correct, cond_total, prev_correct = step_accuracy(
                    correct, valid, al.in_doc[k], prev_correct
                )
                kl_sum = step_kl * (denominator / decay)
                parts = (step_loss.detach(), kl_sum, valid.sum(), full_correct, cond_total)
                rows.append(torch.stack([p.double() for p in parts]))
        return loss, torch.stack(rows)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
