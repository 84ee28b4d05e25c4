"""Hours per stage: estimates, each with its assumption."""

from __future__ import annotations

from eagle3_recipe.gpus import Gpu
from eagle3_recipe.rules.base import Decision
from eagle3_recipe.rules.regeneration import Regeneration
from eagle3_recipe.sizes import target_params
from eagle3_recipe.target import Target

# ---- hours ----------------------------------------------------------------------------------

# H200 measured (docs/benchmarks/gpu-throughput.md): 76,657 tokens/s at the 8B draft shape
# (~425M trainable), 34,030 at Kimi's (1,059M): tokens/s x trainable params ~ 3.4e13 on 989 TFLOP/s.
TRAIN_RATE_PRODUCT = 3.4e13
DECODE_SHARE, PREFILL_SHARE = 0.05, 0.10  # assumptions, not measured here


def hours(
    t: Target,
    gpu: Gpu,
    gpus: int,
    nodes: int,
    trainable: int,
    expected: int,
    regen: Regeneration,
    epochs: int,
) -> Decision:
    if gpu.key == "cpu":
        return Decision("hours", {}, "CPU: minutes (the tiny recipes' figures)")
    flops = gpu.flops * gpus * nodes
    active = target_params(t).active_per_token
    thinking = regen.thinking_fraction or 0.0
    generated = (
        expected
        * ((1 - thinking) * 1500 + thinking * 6000)
        / ((1 - thinking) * 1500 + thinking * 6000 + 500)
    )
    # Regeneration runs on node 0 alone (one `vllm serve` endpoint); extraction and training on all.
    regen_flops = gpu.flops * gpus
    regen_h = generated / (DECODE_SHARE * regen_flops / (2 * active)) / 3600
    extract_h = expected / (PREFILL_SHARE * flops / (2 * active)) / 3600
    rate = TRAIN_RATE_PRODUCT / trainable * (gpu.flops / 989e12) * gpus * nodes
    train_h = expected * epochs / rate / 3600
    value = {"regenerate": regen_h, "extract": extract_h, "train": train_h}
    return Decision(
        "hours",
        value,
        f"estimates: regenerate {generated / 1e6:.0f}M tokens at {DECODE_SHARE:.0%} of "
        f"{regen_flops / 1e15:.1f} PFLOP/s bf16 over 2 x {active / 1e9:.1f}B active params "
        f"(an assumption{'; node 0 alone' if nodes > 1 else ''}); extract {expected / 1e6:.0f}M tokens of prefill at {PREFILL_SHARE:.0%} "
        f"(an assumption); train {epochs} epochs at {rate:,.0f} tokens/s (the H200 bench's "
        f"tokens/s x trainable params ~ 3.4e13, scaled by FLOP/s)",
    )
