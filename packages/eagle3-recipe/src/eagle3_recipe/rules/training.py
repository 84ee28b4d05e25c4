"""Training: MAX_LENGTH from memory per token, the micro-batch, tokens per step and accumulation,
the lrs from width and tokens per step, the schedule, and the ZeRO stage."""

from __future__ import annotations

import math

from eagle3_recipe.gpus import Gpu
from eagle3_recipe.rules.base import (
    LONG_SAMPLES,
    LR_RULE,
    UTILIZATION,
    Decision,
    pow2_ceil,
    pow2_floor,
    significant,
)
from eagle3_recipe.rules.regeneration import PROMPT_TOKENS, Regeneration
from eagle3_recipe.target import PlanError

# ---- memory ---------------------------------------------------------------------------------

# Bytes of training activations per token of the packed sample at hidden 4096 (3 TTT steps,
# bf16): docs/training.md "Long samples" (1.1 MB by arithmetic, an upper bound; 0.78 MB measured on H200).
ACTIVATION_BYTES_4096 = 1.1e6


def activation_bytes_per_token(hidden: int) -> float:
    return ACTIVATION_BYTES_4096 * hidden / 4096


def training_state_bytes(params: int, frozen: int, world: int, zero: str) -> float:
    """fp32 weights (4 B), gradients (4 B) and Adam's two moments (8 B) of the trainable params,
    as ZeRO shards them over ``world``, plus the frozen target rows (fp32)."""
    shard = {
        "ddp": 16 * params,
        "zero2": 4 * params + 12 * params / world,
        "zero3": 16 * params / world,
        "zero2_offload": 4 * params,
    }[zero]
    return shard + 4 * frozen


def max_length(
    regen: Regeneration, gpu: Gpu, hidden: int, state_bytes: float, tools: bool
) -> Decision:
    if gpu.key == "cpu":
        size = 1024 if tools else 512
        return Decision(
            "max_length",
            size,
            f"{size} tokens: the embedded corpus's samples"
            + (" with a tool declaration and an agent loop (up to ~450 tokens)" if tools else ""),
        )
    wanted = pow2_ceil(regen.max_tokens + PROMPT_TOKENS)
    per_token = activation_bytes_per_token(hidden)
    budget = UTILIZATION * gpu.memory_bytes - state_bytes
    fits = int(budget / per_token) if budget > 0 else 0
    arithmetic = (
        f"{UTILIZATION:g} x {gpu.memory_gib:g} GiB - {state_bytes / 1e9:.1f} GB of training state = "
        f"{budget / 1e9:.1f} GB at {per_token / 1e6:.2f} MB/token ({LONG_SAMPLES}: 1.1 MB at "
        f"hidden 4096, scaled by width; 0.78 measured) -> at most {fits:,} tokens per sample"
    )
    if fits >= wanted:
        return Decision(
            "max_length",
            wanted,
            f"{wanted:,}: the answer cap {regen.max_tokens:,} + a {PROMPT_TOKENS:,}-token prompt, "
            f"up to a power of two; it trains whole on one GPU: {arithmetic}",
        )
    largest = pow2_floor(fits)
    if largest < 2048:
        raise PlanError(
            f"--gpu {gpu.key} ({gpu.memory_gib:g} GiB): no 2,048-token sample trains: {arithmetic}"
        )
    return Decision(
        "max_length",
        largest,
        f"{largest:,} (the largest power of two that fits; {wanted:,} wanted for the answer cap "
        f"{regen.max_tokens:,} + prompt): {arithmetic}",
    )


def check_fits(length: int, tokens_per_batch: int, gpu: Gpu, hidden: int, state: float) -> None:
    """A MAX_LENGTH or batch given by hand that cannot train: refused with the largest that fits."""
    per_token = activation_bytes_per_token(hidden)
    budget = UTILIZATION * gpu.memory_bytes - state
    fits = int(budget / per_token) if budget > 0 else 0
    for name, value in (("--max-length", length), ("data.max_tokens_per_batch", tokens_per_batch)):
        if value > fits:
            raise PlanError(
                f"{name} {value:,}: does not fit {gpu.memory_gib:g} GiB: {UTILIZATION:g} x memory - "
                f"{state / 1e9:.1f} GB of state leaves {budget / 1e9:.1f} GB, {fits:,} tokens at "
                f"{per_token / 1e6:.2f} MB/token; the largest that fits is {pow2_floor(fits):,} "
                "(a power of two)"
            )


# ---- the step and its lrs --------------------------------------------------------------------

GPU_ANCHOR = {"hidden": 4096, "tokens": 65536, "adamw": 1.0e-4, "muon": 3.0e-4}
CPU_ANCHOR = {"hidden": 256, "tokens": 2048, "adamw": 1.0e-3, "muon": 5.0e-3}
BENCH_TOKENS = 8192  # the H200 step rates were measured at 8,192 packed tokens per GPU


def largest_fit(gpu: Gpu, hidden: int, state: float) -> int:
    """The longest packed sequence (a power of two) one GPU trains beside ``state`` bytes."""
    budget = UTILIZATION * gpu.memory_bytes - state
    return pow2_floor(budget / activation_bytes_per_token(hidden)) if budget > 0 else 0


def tokens_per_batch(length: int, gpu: Gpu, largest: int) -> Decision:
    if gpu.key == "cpu":
        return Decision("tokens_per_batch", 2048, "2,048: the tiny recipes' micro-batch on CPU")
    size = max(length, min(BENCH_TOKENS, largest))
    return Decision(
        "tokens_per_batch",
        size,
        f"{size:,} = max(MAX_LENGTH, 8,192 where it fits: {largest:,}): one packed sequence per "
        "GPU per micro-batch; a longest sample trains whole, and no fewer tokens than the H200 "
        "bench's step where memory allows (docs/benchmarks/gpu-throughput.md)",
    )


def gradient_accumulation(world: int, batch: int, gpu: Gpu) -> Decision:
    anchor = CPU_ANCHOR if gpu.key == "cpu" else GPU_ANCHOR
    per_pass = world * batch
    steps = max(1, math.ceil(anchor["tokens"] / per_pass))
    tokens = per_pass * steps
    why = f"{world} GPU(s) x {batch:,} tokens x {steps} = {tokens:,} tokens per optimizer step"
    if steps > 1:
        why += (
            f": accumulated up to the anchor's {anchor['tokens']:,}, where its lrs were set "
            "(fewer tokens per step would want lower lrs, by the same rule)"
        )
    return Decision("gradient_accumulation_steps", steps, why)


def learning_rates(hidden: int, tokens_per_step: int, gpu: Gpu) -> Decision:
    """AdamW's and Muon's lrs: the anchor's x (anchor width / width) x sqrt(tokens / anchor's)."""
    anchor = CPU_ANCHOR if gpu.key == "cpu" else GPU_ANCHOR
    width = anchor["hidden"] / hidden
    batch = math.sqrt(tokens_per_step / anchor["tokens"])
    held = ""
    if gpu.key == "cpu" and width > 1:
        held = (
            f"; narrower than the anchor, the width factor {width:g} is held at 1: the sweep puts "
            f"Muon's best at 1e-2 at hidden 128 (~9 % above 5e-3), but the tiny recipes keep one "
            "setting so their published figures stay reproducible"
        )
        width = 1.0
    adamw = significant(anchor["adamw"] * width * batch)
    muon = significant(anchor["muon"] * width * batch)
    name = "GPU anchor (the 8B recipes)" if gpu.key != "cpu" else "CPU anchor (the tiny recipes)"
    return Decision(
        "lr",
        {"adamw": adamw, "muon": muon},
        f"{name}: AdamW {anchor['adamw']:g}, Muon {anchor['muon']:g} at hidden "
        f"{anchor['hidden']:,} and {anchor['tokens']:,} tokens per step; x {anchor['hidden']}/"
        f"{hidden} for width (the best lr halves as the width doubles) x sqrt({tokens_per_step:,}"
        f"/{anchor['tokens']:,}) = {batch:.3g} for the step (4x the tokens wants lr x 2) "
        f"({LR_RULE}){held}. A first run should still sweep Muon's lr 2x either side on a slice "
        "(the rule is measured at hidden 128 and 256 only)",
    )


def schedule(tokens_per_step: int, gpu: Gpu, trainable: int) -> Decision:
    if gpu.key == "cpu":
        return Decision(
            "schedule",
            {"warmup_steps": 30, "save_every": 200, "epochs": 4},
            "the tiny recipes' warmup 30, saves every 200, 4 epochs",
        )
    scale = GPU_ANCHOR["tokens"] / tokens_per_step
    warmup = max(1, round(200 * scale))
    save = max(1, round(500 * scale))
    epochs = 3 if trainable >= 1e9 else 5
    return Decision(
        "schedule",
        {"warmup_steps": warmup, "save_every": save, "epochs": epochs},
        f"warmup {warmup} and saves every {save} steps: the 8B recipes' 200 and 500 steps of "
        f"65,536 tokens, in tokens (~13M and ~33M); {epochs} epochs ("
        + (
            "a draft of >= 1B trainable parameters costs 2.5x the 8B's per token: 3, as the "
            "Kimi-K2.5 recipe"
            if epochs == 3
            else "the 8B recipes'"
        )
        + "; not measured against other counts)",
    )


# ---- training memory: ZeRO ------------------------------------------------------------------

ZERO2_ABOVE = 16e9  # fp32 state bytes of the draft above which ZeRO-2 shards them


def zero_stage(
    params: int, frozen: int, world: int, length: int, hidden: int, gpu: Gpu
) -> Decision:
    if gpu.key == "cpu" or world == 1:
        return Decision("zero", "ddp", "one process (or DDP): nothing to shard")
    activations = length * activation_bytes_per_token(hidden)
    budget = UTILIZATION * gpu.memory_bytes
    full = 16 * params
    order = (
        ["ddp", "zero2", "zero3", "zero2_offload"]
        if full <= ZERO2_ABOVE
        else ["zero2", "zero3", "zero2_offload"]
    )
    for zero in order:
        state = training_state_bytes(params, frozen, world, zero)
        if state + activations <= budget:
            why = (
                f"{params / 1e6:,.1f}M trainable params x 16 B = {full / 1e9:.1f} GB of fp32 state"
                f" (+ {4 * frozen / 1e9:.1f} GB frozen target rows); under {zero}: "
                f"{state / 1e9:.1f} GB + {activations / 1e9:.1f} GB of activations at {length:,} "
                f"tokens <= {budget / 1e9:.1f} GB ({UTILIZATION:g} x {gpu.memory_gib:g} GiB)"
            )
            if zero == "ddp":
                why += (
                    "; under 16 GB of state plain DDP (no DeepSpeed engine between user and loop)"
                )
            elif zero == "zero2" and full > ZERO2_ABOVE:
                why += (
                    f"; above 16 GB ZeRO-2 shards gradients and Adam over {world} ranks: its "
                    "reduce-scatter + all-gather move what DDP's all-reduce moves"
                )
            return Decision("zero", zero, why)
    raise PlanError(
        f"the draft's training does not fit {gpu.memory_gib:g} GiB even under ZeRO-2 with "
        f"optimizer offload at {length:,} tokens per sample: lower --max-length"
    )


ACCELERATE_CONFIG = {
    "ddp": "recipes/accelerate/ddp.yaml",
    "zero2": "recipes/accelerate/zero2.yaml",
    "zero3": "recipes/accelerate/zero3.yaml",
    "zero2_offload": "recipes/accelerate/zero2_offload.yaml",
}
