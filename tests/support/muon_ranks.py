"""One rank of a gloo process group stepping ShardedMuon over a fixed problem, for
packages/eagle3-train/tests/test_sharded_muon.py: the matrices, their gradients and the Muon
settings are made here from a seed, the same in every process, so that the test's one-process
torch.optim.Muon steps on exactly what the ranks step on.

    PYTHONPATH=tests python -m support.muon_ranks RANK WORLD INIT_FILE OUT
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

# Unequal shapes, both orientations (Newton–Schulz transposes tall matrices), one repeated.
SHAPES = [(96, 32), (32, 96), (64, 64), (64, 64), (128, 16), (24, 8)]
STEPS = 3
SETTINGS = dict(lr=0.02, momentum=0.95, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")


def problem() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """(initial matrices, each step's gradients)."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator) for shape in SHAPES]
    grads = [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(STEPS)]
    return params, grads


def run(optimizer_class: type[torch.optim.Optimizer]) -> dict[str, object]:
    """Steps ``optimizer_class`` over the problem: the matrices, momentum buffers and the FLOPs
    counted in each step."""
    initial, grads = problem()
    params = [torch.nn.Parameter(p.clone()) for p in initial]
    optimizer = optimizer_class(params, **SETTINGS)
    flops = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        with FlopCounterMode(display=False) as counter:
            optimizer.step()
        flops.append(counter.get_total_flops())
    return {
        "params": [p.detach() for p in params],
        "momentum": [optimizer.state[p]["momentum_buffer"] for p in params],
        "flops": flops,
    }


def main(rank: int, world: int, init_file: str, out: str) -> None:
    from eagle3_train.components.sharded_muon import ShardedMuon

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.save(run(ShardedMuon), out)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
