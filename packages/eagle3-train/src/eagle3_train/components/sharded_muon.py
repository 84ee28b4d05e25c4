"""torch's Muon with each matrix's Newton–Schulz orthogonalisation computed by one rank, not all.

Under DDP every rank holds the same all-reduced gradients, so torch.optim.Muon computes the same
Newton–Schulz iterations on every rank: at the 8B recipe's draft about 27 TFLOP per optimizer
step, repeated world-size times. Here each matrix is owned by one rank (the largest matrices
first, each to the least loaded rank, the same plan on every rank), the owner orthogonalises it,
and a broadcast hands the result to the others. Everything else is torch's step, in torch's
order: the momentum buffers stay on every rank (the checkpoint is unchanged), and the update is
bit-equal to torch's on every rank, because the owner's iteration is the one each rank would
have run on the same input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz


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


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon whose orthogonalisations are shared out across the process group's
    ranks (one rank per matrix, then a broadcast). One process: torch's step unchanged."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world == 1:
            return super().step(closure)
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
        rank = dist.get_rank()
        plan = owners([p.shape for _, p, _ in entries], world)
        orthogonal, pending = [], []
        for (group, _, update), owner in zip(entries, plan, strict=True):
            if owner == rank:
                args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
                ortho = _zeropower_via_newtonschulz(update, *args).contiguous()
            else:  # what the owner's iteration returns: bf16, the update's shape
                ortho = torch.empty(update.shape, dtype=torch.bfloat16, device=update.device)
            pending.append(dist.broadcast(ortho, src=owner, async_op=True))
            orthogonal.append(ortho)
        for work in pending:
            work.wait()
        for (group, p, _), ortho in zip(entries, orthogonal, strict=True):
            lr, weight_decay = group["lr"], group["weight_decay"]
            p.mul_(1 - lr * weight_decay)
            p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss
