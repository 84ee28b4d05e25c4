"""The training objective written plainly, for the tests of the fused one."""

from __future__ import annotations

import torch
from torch import Tensor


def reference_linear_kl(
    h: Tensor,
    weight: Tensor,
    target_logp: Tensor,
    row_weights: Tensor,
    topk: int = 0,
    topk_weight: float = 0.0,
    divergence: str = "kl",
    lk_eta: float = 3.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Plain-autograd twin of ``eagle3_train.model.loss.fused_linear_kl`` (tests compare the two; the
    top-k term and the divergences from their definitions, without ``TargetTopK`` or hand-made
    gradients). float32, float64 for float64 inputs."""
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    logits = h.to(dtype) @ weight.to(dtype).T
    logq = torch.log_softmax(logits, dim=-1)
    kl = (target_logp.exp() * (target_logp - logq)).sum(-1)
    tv = 0.5 * (target_logp.exp() - logq.exp()).abs().sum(-1)
    lam = torch.exp(-lk_eta * (1 - tv.detach()))
    loss = {"kl": kl, "tv": tv, "lk": lam * kl + (1 - lam) * tv}[divergence]
    if topk_weight:
        top_logp, top_ids = target_logp.topk(topk, dim=-1)
        loss = loss - topk_weight * (top_logp.exp() * logq.gather(-1, top_ids)).sum(-1)
    return (loss * row_weights).sum(), (kl * row_weights).sum().detach(), logits.argmax(-1)
