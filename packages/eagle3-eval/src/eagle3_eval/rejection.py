"""Verification of a chain of draft tokens against the target: greedy and rejection sampling.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) keeps the output distribution
exactly the target's: draft token d with draft probability q(d) is accepted with probability
min(1, p(d) / q(d)); on the first rejection the token is drawn from normalise(max(p - q, 0));
when all k are accepted a bonus token is drawn from the target's next distribution.

vLLM 0.32 drafts greedily by default (``draft_sample_method="greedy"``) and then treats the
draft distribution as one-hot: accept with probability p(d), on rejection draw from p with d
removed. ``draft_probs=None`` selects that variant; it is exact too (q = δ_d is a valid draft
distribution).
"""

from __future__ import annotations

import torch
from torch import Tensor


def target_probs(logits: Tensor, temperature: float) -> Tensor:
    """Softmax of logits / temperature, float32 (temperature > 0)."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(probs: Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def verify_greedy(target_logits: Tensor, draft_tokens: Tensor) -> tuple[int, int]:
    """target_logits [k+1, V] at the positions of (last token, d_1..d_k); draft_tokens [k].

    Returns (accepted prefix length a, the target's token after it): the target's argmax at
    position a, which is the correction when a < k and the bonus token when a == k.
    """
    target = target_logits.argmax(dim=-1)
    k = draft_tokens.shape[0]
    accepted = 0
    while accepted < k and int(draft_tokens[accepted]) == int(target[accepted]):
        accepted += 1
    return accepted, int(target[accepted])


def verify_sampled(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    temperature: float,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Rejection sampling. draft_probs [k, V] (target vocabulary), or None for greedy drafts.

    Returns (accepted prefix length a, the next token: recovered on rejection, else bonus).
    """
    p = target_probs(target_logits, temperature)
    k = draft_tokens.shape[0]
    for i in range(k):
        d = int(draft_tokens[i])
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        u = float(torch.rand((), generator=generator))
        # u < p/q written as u*q < p: no division, and q_d == 0 (impossible draw) rejects.
        if u * q_d < float(p[i, d]):
            continue
        if draft_probs is None:
            residual = p[i].clone()
            residual[d] = 0.0
        else:
            residual = torch.clamp(p[i] - draft_probs[i].float(), min=0.0)
        total = float(residual.sum())
        if total <= 0.0:
            # p == q on the support (rejection had probability 0 up to rounding): draw from p.
            residual = p[i]
        return i, sample(residual, generator)
    return k, sample(p[k], generator)
