"""Disk: the hidden states' storage dtype and streaming under a budget."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_recipe.rules.base import FP8_MEASURED, Decision
from eagle3_recipe.sizes import stored_bytes_per_token
from eagle3_recipe.target import PlanError, Target

# ---- disk -----------------------------------------------------------------------------------

FP8_FROM_HIDDEN = 6144
SHARD_BYTES = 1024 * 2**20  # eagle3-extract's default --shard-mb 1024


@dataclass(frozen=True)
class Storage:
    dtype: str
    bytes_per_token: int
    expected_bytes: float
    bound_bytes: float
    stream: bool


def storage(
    t: Target, n_aux: int, expected: int, bound: int, disk_budget: float | None
) -> Decision:
    if disk_budget is not None and disk_budget < SHARD_BYTES:
        raise PlanError(
            f"--disk-budget {disk_budget / 1e9:.2f} GB: below one shard ({SHARD_BYTES / 1e9:.2f} "
            "GB, eagle3-extract's --shard-mb 1024); a stream needs at least one sealed shard"
        )
    h = t.hidden_size
    bf16 = stored_bytes_per_token(h, n_aux, "bfloat16")
    fp8 = stored_bytes_per_token(h, n_aux, "fp8_e4m3")
    over_budget = disk_budget is not None and expected * bf16 > disk_budget
    dtype = "fp8_e4m3" if h >= FP8_FROM_HIDDEN or over_budget else "bfloat16"
    per = fp8 if dtype == "fp8_e4m3" else bf16
    stream = disk_budget is not None and expected * per > disk_budget
    why = (
        f"{per:,} B/token ({n_aux} aux + the last state at H {h:,}"
        + (", fp8 + a float32 scale per row" if dtype == "fp8_e4m3" else ", bf16")
        + f"): ~{expected * per / 1e12:.2f} TB for ~{expected / 1e6:.0f}M tokens (bound "
        f"{bound * per / 1e12:.2f} TB at SAMPLES x MAX_LENGTH). "
    )
    if dtype == "fp8_e4m3":
        why += (
            f"fp8: half the disk, no acceptance cost measured ({FP8_MEASURED}: 3.157 vs 3.151 "
            "tiny, 3.232 vs 3.218 MLA, seeds 0-2)"
            + (
                f", chosen as H >= {FP8_FROM_HIDDEN:,} makes disk the limit"
                if h >= FP8_FROM_HIDDEN
                else ", chosen as bf16 exceeds the disk budget"
            )
        )
    else:
        why += (
            f"bf16: below H {FP8_FROM_HIDDEN:,} disk is not the limit, and fp8 is unmeasured on "
            "real targets' outlier channels"
        )
    if stream:
        why += (
            f"; over the {disk_budget / 1e12:.2f} TB budget: streamed (eagle3-extract run --stream "
            "--disk-budget, recipes/STREAMING.md), consumed shards reclaimed"
        )
    value = Storage(dtype, per, expected * per, bound * per, stream)
    return Decision("storage", value, why)
