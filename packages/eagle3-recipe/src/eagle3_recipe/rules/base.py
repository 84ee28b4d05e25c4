"""What every rule returns (``Decision``), the files they cite, and shared arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

HOW_GOOD = "docs/benchmarks/vs-speculators.md"
LR_RULE = "docs/benchmarks/lr-width.md"
LONG_SAMPLES = 'docs/training.md "Long samples"'
TRAFFIC_MIX = (
    "recipes/kimi-k2.5/flags.sh (tools/bench/bench_traffic_mix.sh, docs/benchmarks/traffic-mix.md)"
)
FP8_MEASURED = 'recipes/kimi-k2.5/RESOURCES.md "Disk"'
TIGHT_SHARE = 0.10  # eagle3_extract/sizing.py: less left after the weights is "tight"
UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization in the recipes, and the training budget


@dataclass(frozen=True)
class Decision:
    name: str
    value: Any
    reason: str


def significant(x: float, digits: int = 2) -> float:
    """``x`` to ``digits`` significant digits (the recipes write lrs so: 1.1e-4, 3.4e-4)."""
    return float(f"{x:.{digits - 1}e}")


def pow2_floor(x: float) -> int:
    return 2 ** math.floor(math.log2(x)) if x >= 1 else 0


def pow2_ceil(x: float) -> int:
    return 2 ** math.ceil(math.log2(x))
