"""torch's Muon with each matrix's Newton–Schulz orthogonalisation computed by one rank, not all,
in the precision the device multiplies fastest.

Under DDP every rank holds the same all-reduced gradients, so torch.optim.Muon computes the same
Newton–Schulz iterations on every rank: at the 8B recipe's draft about 27 TFLOP per optimizer
step, repeated world-size times. Here each matrix is owned by one rank (the largest matrices
first, each to the least loaded rank, the same plan on every rank), the owner orthogonalises it,
and a broadcast hands the result to the others. Everything else is torch's step, in torch's
order: the momentum buffers stay on every rank (the checkpoint is unchanged), and the update is
bit-equal to torch's on every rank, because the owner's iteration is the one each rank would
have run on the same input.

torch iterates in bf16, which CUDA's tensor cores multiply at full rate. A CPU without bf16
matrix units (AVX2, most AVX-512) emulates it, 33x slower than float32 on a 256 x 1024 matrix
here: on the tiny recipes that was half of every step. So the iteration's dtype is a setting,
bf16 by default (torch's step bit for bit) and float32 where make_muon runs on a CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr


def owners(shapes: list[torch.Size], world: int) -> list[int]:
    """The rank that orthogonalises each matrix: the largest first, each to the rank with the
    fewest Newton–Schulz FLOPs so far (a matrix's cost grows as rows·cols·min(rows, cols))."""
    load = [0] * world
    owner = [0] * len(shapes)
    by_size = sorted(range(len(shapes)), key=lambda i: (-shapes[i].numel(), i))
    for i in by_size:
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += shapes[i].numel() * min(shapes[i])
    return owner


def newton_schulz(
    update: torch.Tensor,
    coefficients: tuple[float, float, float],
    steps: int,
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The quintic Newton–Schulz orthogonalisation of torch.optim.Muon, iterated in ``dtype``:
    with bf16 the same operations in the same order as torch's, so the same bits."""
    a, b, c = coefficients
    tall = update.size(0) > update.size(1)
    x = update.to(dtype, copy=True)  # a copy even when dtypes agree: the buffer stays untouched
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisations are shared out across the process group's
    ranks (one rank per matrix, then a broadcast), iterated in ``newton_schulz_dtype``. One
    process with bf16: torch's step unchanged."""

    def __init__(self, params, *, newton_schulz_dtype: torch.dtype = torch.bfloat16, **settings):
        super().__init__(params, **settings)
        self.newton_schulz_dtype = newton_schulz_dtype

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        entries = []  # (group, param, update before orthogonalisation), in torch's order
        for group in self.param_groups:
            momentum = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(
                        p.grad, memory_format=torch.preserve_format
                    )
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - momentum)
                update = p.grad.lerp(buf, momentum) if group["nesterov"] else buf
                entries.append((group, p, update))
        rank = dist.get_rank() if world > 1 else 0
        plan = owners([p.shape for _, p, _ in entries], world)
        orthogonal, pending = [], []
        for (group, _, update), owner in zip(entries, plan, strict=True):
            if owner == rank:
                args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
                ortho = newton_schulz(update, *args, self.newton_schulz_dtype).contiguous()
            else:  # what the owner's iteration returns, in the update's shape
                ortho = torch.empty(
                    update.shape, dtype=self.newton_schulz_dtype, device=update.device
                )
            if world > 1:
                pending.append(dist.broadcast(ortho, src=owner, async_op=True))
            orthogonal.append(ortho)
        for work in pending:
            work.wait()
        for (group, p, _), ortho in zip(entries, orthogonal, strict=True):
            lr, weight_decay = group["lr"], group["weight_decay"]
            p.mul_(1 - lr * weight_decay)
            p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
