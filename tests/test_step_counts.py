"""tools/gpu/step_counts.py: one training step's FLOPs and bytes counted on fake cuda:0 tensors,
checked against the formulas of the kernels it runs, at a small shape."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from eagle3_train.components.build import muon_split
from eagle3_train.config.train_config import MuonConfig
from eagle3_train.model.draft import Eagle3Draft

from support.scripts import load_script

pytestmark = pytest.mark.cuda_dry_run
TOOL = load_script(Path(__file__).resolve().parents[1] / "tools" / "gpu" / "step_counts.py")
# two documents of 1,024 tokens: more scored rows per TTT step than one 1,024-row loss chunk
TOOL.SHAPES["small"] = (64, 4, 128, 512, 256, (1024, 1024))


@pytest.fixture(scope="module")
def counted() -> dict[str, dict[str, dict[str, float]]]:
    return {variant: TOOL.count_step("small", variant) for variant in TOOL.VARIANTS}


def test_a_step_counts_the_same_twice(counted) -> None:
    """Only the ops the step calls count: a decomposition's first-time ops (they come back
    through the fake mode's dispatch) would make the first count larger."""
    assert TOOL.count_step("small", "recipes") == counted["recipes"]


def test_attention_and_newton_schulz_flops_are_their_kernels(counted) -> None:
    recipes = counted["recipes"]
    arch = TOOL.draft_arch("small")
    heads, width = arch.num_attention_heads, arch.head_dim
    pairs = 2 * (1024 * 1025 // 2)
    # 3 TTT steps, each a forward and a backward (twice the forward) kernel call
    assert recipes["attention"]["flops"] == 3 * 3 * 2 * heads * 2 * width * pairs
    steps = MuonConfig().ns_steps
    matrices, _ = muon_split(Eagle3Draft(arch))
    newton_schulz = 0
    for p in matrices:
        m, n = sorted(p.shape)
        newton_schulz += steps * (4 * m * m * n + 2 * m**3)  # X Xᵀ, A + A², then (…) X
    assert recipes["optimizer, Newton–Schulz GEMMs"]["flops"] == newton_schulz
    assert "flops" not in counted["bench"]["optimizer, Newton–Schulz GEMMs"]  # AdamW


def test_the_head_gradient_in_one_gemm_moves_fewer_bytes(counted) -> None:
    """The LM head's dW as one GEMM per TTT step against a float32 [V, H] accumulation after
    every loss chunk: the same FLOPs, fewer bytes. The layers' GEMMs are the same in every
    variant; the frozen head of the bench's settings does fewer."""
    before, after = counted["recipes, before"], counted["recipes"]
    head = "GEMM, LM heads"
    assert before[head]["flops"] == after[head]["flops"]
    arch = TOOL.draft_arch("small")
    accumulator = arch.draft_vocab_size * arch.hidden_size * torch.float32.itemsize
    # per TTT step: a second chunk's flush reads and writes the accumulator once more
    assert before[head]["bytes"] - after[head]["bytes"] >= 3 * 2 * accumulator
    assert {v["GEMM, layers"]["flops"] for v in counted.values()} == {
        after["GEMM, layers"]["flops"]
    }
    assert counted["bench"][head]["flops"] < after[head]["flops"]
    assert all(v["host→device copies"]["bytes"] > 0 for v in counted.values())


def test_the_layers_weights_cast_once_move_fewer_bytes() -> None:
    """The layers' GEMM weights cast once per step and shared by the TTT calls
    (draft.cast_once), against a cast in every call, as compiled layers did before: per weight
    element and TTT call after the first, the forward saves a cast (4 bytes read, 2 written)
    and backward a float32 gradient's cast and its float32 sum (the bf16 sum remains): 6 + 12
    bytes. Nothing else changes, FLOPs included."""
    TOOL.VARIANTS["recipes, cast per call"] = (*TOOL.VARIANTS["recipes"][:5], True)
    try:
        before = TOOL.count_step("small", "recipes, cast per call")
    finally:
        del TOOL.VARIANTS["recipes, cast per call"]
    after = TOOL.count_step("small", "recipes")
    model = Eagle3Draft(TOOL.draft_arch("small"))
    weights = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, nn.Linear))
    saved = {p: before[p].get("bytes", 0) - after[p].get("bytes", 0) for p in before}
    assert saved == {p: 0 for p in saved} | {
        "element-wise and reductions": (3 - 1) * (6 + 12) * weights
    }, saved
    assert {p: c.get("flops") for p, c in before.items()} == {
        p: c.get("flops") for p, c in after.items()
    }
