"""The flash path's self-check (what preflight and the GPU check run on a device) tested as a
check: it passes the real kernel and fails each planted bug on values and on gradients."""

from __future__ import annotations

import pytest
import torch

from eagle3_train.model import flash_attention
from eagle3_train.model.flash_attention import flash_self_check, flash_ttt_attention

CPU = torch.device("cpu")


def _kinds(problems: list[str]) -> set[str]:
    """Which of values / gradients / the negative control the problems name."""
    kinds = set()
    for p in problems:
        if p.startswith("out: max error"):
            kinds.add("values")
        elif p.startswith("grad ") and "max error" in p:
            kinds.add("gradients")
        elif p.startswith("negative control"):
            kinds.add("control")
    return kinds


def test_the_real_kernel_passes_and_its_negative_control_fires_on_values_and_gradients():
    """No problem means the control (one diagonal key moved) failed the bound on the values
    and on a gradient: either passing would have been reported as a blind check."""
    assert flash_self_check(CPU) == []


def test_a_kernel_with_its_log_sum_exp_rows_reordered_fails_on_values_and_gradients(
    monkeypatch,
):
    """A kernel whose log-sum-exp comes back with its rows in another order (what a torch
    with another layout gives): the merge weighs the step-0 keys wrongly (values) and the
    backward's softmax is rebuilt from it (gradients)."""
    real = flash_attention._kernel_forward

    def rows_reordered(*args):
        out, lse = real(*args)  # lse [heads, T]: each query's row moved to its neighbour
        return out, lse.roll(1, dims=-1).contiguous()

    monkeypatch.setattr(flash_attention, "_kernel_forward", rows_reordered)
    problems = flash_self_check(CPU)
    assert {"values", "gradients"} <= _kinds(problems), problems


def test_a_kernel_that_moves_a_diagonal_key_fails_on_values_and_gradients():
    def key_moved(q, k0, v0, kd, vd, cu, max_len):
        moved = kd.clone()
        moved[0, :, 7] = kd[0, :, 8]  # slot 7's TTT-step-1 key is its neighbour's
        return flash_ttt_attention(q, k0, v0, moved, vd, cu, max_len)

    problems = flash_self_check(CPU, attention=key_moved)
    assert {"values", "gradients"} <= _kinds(problems), problems


def test_the_kernel_custom_ops_agree_with_their_fake_implementations():
    """eagle3::flash_forward/backward as torch.library checks a custom op: its schema, its
    fake implementation against the real one (shapes, dtypes, strides), and AOT dispatch."""
    g = torch.Generator().manual_seed(0)
    T, nh, nkv, d = 29, 4, 2, 16
    cu = torch.tensor([0, 11, 16, 29], dtype=torch.int32)
    q, k, v, grad = (
        torch.randn(T, h, d, generator=g, dtype=torch.bfloat16) for h in (nh, nkv, nkv, nh)
    )
    out, lse = torch.ops.eagle3.flash_forward(q, k, v, cu, 13, 0.25)
    torch.library.opcheck(torch.ops.eagle3.flash_forward, (q, k, v, cu, 13, 0.25))
    args = (grad, q, k, v, out, lse, cu, 13, 0.25)
    torch.library.opcheck(torch.ops.eagle3.flash_backward, args)


@pytest.mark.process  # Inductor's CPU code is built by the C++ compiler
def test_the_compiled_flash_path_passes_the_self_check_in_one_graph():
    """train.compile's flash path (kernel custom ops inside one compiled function, forward and
    backward, here with Inductor's CPU code) passes the same check as the eager one, with no
    graph break: the merge is Inductor's to fuse."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    flash_attention.compile_flash_attention(True)
    try:
        assert flash_self_check(CPU) == []
    finally:
        flash_attention.compile_flash_attention(False)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
