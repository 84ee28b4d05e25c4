"""Arithmetic on a target's config: parameters, weight bytes, KV cache and stored bytes per token,
and the draft's trainable parameters. No rule lives here, only counting; the rules that use these
figures are in ``rules``.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_recipe.target import Target

BF16 = 2
FP8 = 1
# compressed-tensors int4 with one bf16 scale per group of 32: 4 bits + 16 / 32 bits per weight.
INT4_GROUP32 = 0.5 + 2 / 32


@dataclass(frozen=True)
class Params:
    embeddings: int  # input embedding + LM head (one matrix when tied)
    attention: int
    dense_mlp: int  # dense layers' MLPs
    routed_experts: int  # every routed expert of every MoE layer
    shared: int  # shared experts and routers
    active_per_token: int  # what one token's forward multiplies through

    @property
    def total(self) -> int:
        return self.embeddings + self.attention + self.dense_mlp + self.routed_experts + self.shared


def target_params(t: Target) -> Params:
    c, h, n = t.config, t.hidden_size, t.num_layers
    embeddings = t.vocab_size * h * (1 if t.tied else 2)
    if t.mla:
        heads = t.num_heads
        qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
        q_lora = c.get("q_lora_rank")
        q = h * q_lora + q_lora * heads * qk if q_lora else h * heads * qk
        kv = h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
        kv += c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"])
        attention = n * (q + kv + heads * c["v_head_dim"] * h)
    else:
        hd = t.head_dim
        attention = n * (2 * h * t.num_heads * hd + 2 * h * t.num_kv_heads * hd)
    experts = int(c.get("n_routed_experts") or c.get("num_experts") or 0)
    if experts:
        moe_i = int(c["moe_intermediate_size"])
        dense_layers = int(c.get("first_k_dense_replace") or 0)
        moe_layers = n - dense_layers
        dense_mlp = dense_layers * 3 * h * int(c["intermediate_size"])
        routed = moe_layers * experts * 3 * h * moe_i
        shared_experts = int(c.get("n_shared_experts") or 0)
        shared = moe_layers * (shared_experts * 3 * h * moe_i + h * experts)
        top_k = int(c.get("num_experts_per_tok") or 1)
        active_routed = moe_layers * top_k * 3 * h * moe_i
    else:
        dense_mlp = n * 3 * h * int(c["intermediate_size"])
        routed = shared = active_routed = 0
    active = attention + dense_mlp + active_routed + shared + t.vocab_size * h
    return Params(embeddings, attention, dense_mlp, routed, shared, active)


def weight_bytes(t: Target) -> tuple[float, str]:
    """The checkpoint's bytes on the GPU, and how they were counted."""
    p = target_params(t)
    quant = t.config.get("quantization_config") or {}
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        bits = _group_bits(quant)
        if bits == 4:
            # Kimi-K2.5's checkpoint: int4 routed experts, the rest (attention, shared, dense) bf16.
            total = p.routed_experts * INT4_GROUP32 + (p.total - p.routed_experts) * BF16
            return total, "int4 routed experts (group 32, bf16 scales), the rest bf16"
    if method == "fp8":
        layers = p.attention + p.dense_mlp + p.routed_experts + p.shared
        return layers * FP8 + p.embeddings * BF16, "fp8 decoder weights, bf16 embeddings"
    return p.total * BF16, "bf16"


def _group_bits(quant: dict[str, object]) -> int | None:
    groups = quant.get("config_groups")
    if isinstance(groups, dict):
        for group in groups.values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if isinstance(weights, dict) and isinstance(weights.get("num_bits"), int):
                return int(weights["num_bits"])
    return None


def kv_bytes_per_token(t: Target, tp: int) -> int:
    """vLLM's KV cache bytes per token per GPU in bf16: MLA's latent on every rank; else K, V of
    the rank's KV heads (replicated when TP exceeds them)."""
    c = t.config
    if t.mla:
        return t.num_layers * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * BF16
    return t.num_layers * 2 * max(1, t.num_kv_heads // tp) * t.head_dim * BF16


def stored_bytes_per_token(hidden: int, n_aux: int, storage_dtype: str) -> int:
    """Bytes per token of the hidden-state shards (the aux states and the last one, input id
    int32 and loss-mask byte; fp8 adds a float32 scale per stored layer), as eagle3-extract
    writes them."""
    layers = n_aux + 1
    if storage_dtype == "fp8_e4m3":
        return layers * hidden * FP8 + layers * 4 + 5
    return layers * hidden * BF16 + 5


def draft_trainable_params(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, draft_vocab: int
) -> int:
    """One Llama-style EAGLE-3 layer: fc (3H -> H), attention reading 2H (q, k, v; o), MLP, the
    draft LM head, and its norms."""
    fc = 3 * hidden * hidden
    attention = 2 * hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * intermediate
    return fc + attention + mlp + draft_vocab * hidden + 4 * hidden
