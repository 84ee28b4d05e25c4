"""TTT alignment (THE shift), forward KL over the draft vocabulary, per-step metrics.

The shift — applied here and nowhere else
-----------------------------------------
Stored data follows the schema convention: row ``t`` of every tensor belongs to position
``t`` (the target has seen ``x_0..x_t``; its distribution at ``t`` predicts ``x_{t+1}``;
``loss_mask[t] = 1`` when ``x_t`` is an assistant token).

The draft's *slot* ``t`` at TTT step ``k`` (k = 0 .. ttt_steps-1):

- is fed ``fc(aux[t])`` (step 0; later steps feed back the draft's own output) and the
  embedding of token ``x_{t+1+k}``;
- is trained toward the target distribution of row ``t+1+k``, i.e. the target's
  ``p(x_{t+2+k} | x_0..x_{t+1+k})`` restricted to the draft vocabulary;
- is scored where ``loss_mask[t+1+k] = 1`` and ``t+1+k`` lies in the same packed
  document as ``t``.

This is vLLM's serving alignment: ``EagleProposer.propose`` shifts the token ids left by one
(``input_ids[:-1] = target_token_ids[1:]``, last = the token just sampled) and pairs them
with the target hidden states of the *same* rows, at the rows' own positions; each further
draft step advances token and position by one. The draft runs exactly after the target has
produced ``x_{t+1}``, so the mask is read at the fed token ``t+1+k``: a slot counts when
the token it is conditioned on is an assistant token. speculators 0.9.0 arrives at the
same pairs by dropping ``x_0``, ``aux[T-1]``, ``last[0]``, ``loss_mask[0]`` per sample
(``shift_batch``) and then sliding targets by ``k`` per step.

Positions: slot ``t`` uses position ``t - doc_start`` (+k at step k), as vLLM does
(speculators uses ``+1``; RoPE only sees differences, so both give the same attention).

Differences from speculators by design (tests state them):
- speculators scores step ``k`` of the last ``k`` slots of a packed document against the
  *next* document's first rows; here those slots are not scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOSS_EPS = 1e-5  # added to each step's loss denominator, as speculators does


@dataclass(frozen=True)
class Alignment:
    """Per TTT step: which token each slot is fed, and which slots are scored."""

    doc_start: Tensor  # [T] long: first row of the slot's document
    positions: Tensor  # [T] long: position of slot t at step 0 (t - doc_start)
    step_tokens: list[Tensor]  # per step k: [T] long, x_{t+1+k} (0 past the end; never scored)
    in_doc: list[Tensor]  # per step k: [T] bool, t+1+k inside t's document
    valid: list[Tensor]  # per step k: [T] bool, in_doc & loss_mask[t+1+k]


def document_bounds(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """doc_start [T] and doc_end [T] (exclusive) of every row of a packed sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    ends = torch.repeat_interleave(cu_seqlens[1:], lengths, output_size=total)
    return starts, ends


def align(input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, ttt_steps: int) -> Alignment:
    """The one shift (see the module docstring) for a packed, unshifted batch."""
    T = input_ids.shape[0]
    doc_start, doc_end = document_bounds(cu_seqlens, T)
    rows = torch.arange(T, device=input_ids.device)
    mask = loss_mask.bool()
    step_tokens, in_doc, valid = [], [], []
    for k in range(ttt_steps):
        src = rows + 1 + k
        inside = src < doc_end
        safe = src.clamp(max=T - 1)
        step_tokens.append(torch.where(src < T, input_ids[safe], torch.zeros_like(input_ids)))
        in_doc.append(inside)
        valid.append(inside & mask[safe])
    return Alignment(doc_start, rows - doc_start, step_tokens, in_doc, valid)


class _FusedLinearKL(torch.autograd.Function):
    """sum_t w_t · KL(p_t || softmax(h_t W^T)) with gradients formed chunk by chunk in forward.

    Draft logits exist one chunk at a time; the backward only rescales the stored gradients.
    Also returns the argmax of each row's draft logits (no gradient) for the metrics.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: Tensor,
        weight: Tensor,
        target_logp: Tensor,
        row_weights: Tensor,
        chunk: int,
    ) -> tuple[Tensor, Tensor]:
        # logits, softmax and gradients in float32 even under bf16 autocast
        with torch.autocast(h.device.type, enabled=False):
            return _FusedLinearKL._forward(ctx, h, weight, target_logp, row_weights, chunk)

    @staticmethod
    def _forward(
        ctx: torch.autograd.function.FunctionCtx,
        h: Tensor,
        weight: Tensor,
        target_logp: Tensor,
        row_weights: Tensor,
        chunk: int,
    ) -> tuple[Tensor, Tensor]:
        n = h.shape[0]
        need_h = ctx.needs_input_grad[0]  # type: ignore[attr-defined]
        need_w = ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        cdt = h.dtype if h.dtype in (torch.float32, torch.float64) else torch.float32
        w32 = weight.to(cdt)
        grad_h = torch.empty(h.shape, dtype=cdt, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=cdt, device=h.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        preds = torch.empty(n, dtype=torch.long, device=h.device)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            hc = h[c0:c1].to(cdt)
            logits = hc @ w32.T
            preds[c0:c1] = logits.argmax(-1)
            logq = torch.log_softmax(logits, dim=-1)
            logp = target_logp[c0:c1]
            p = logp.to(cdt).exp()
            logp = logp.to(cdt)
            rw = row_weights[c0:c1].to(cdt)
            kl = (p * (logp - logq)).sum(-1)
            total += (kl * rw).sum()
            if need_h or need_w:
                # d KL / d logits = softmax(logits) - p (p sums to one over the draft vocab)
                g = logq.exp_().sub_(p).mul_(rw.unsqueeze(-1))
                if grad_h is not None:
                    grad_h[c0:c1] = g @ w32
                if grad_w is not None:
                    grad_w += g.T @ hc
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.has = (grad_h is not None, grad_w is not None)  # type: ignore[attr-defined]
        ctx.dtypes = (h.dtype, weight.dtype)  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(preds)
        return total, preds

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_total: Tensor, _grad_preds: Tensor):  # type: ignore[override]
        saved = list(ctx.saved_tensors)  # type: ignore[attr-defined]
        has_h, has_w = ctx.has  # type: ignore[attr-defined]
        h_dtype, w_dtype = ctx.dtypes  # type: ignore[attr-defined]
        grad_h = (saved.pop(0) * grad_total).to(h_dtype) if has_h else None
        grad_w = (saved.pop(0) * grad_total).to(w_dtype) if has_w else None
        return grad_h, grad_w, None, None, None


def fused_linear_kl(
    h: Tensor, weight: Tensor, target_logp: Tensor, row_weights: Tensor, chunk: int = 1024
) -> tuple[Tensor, Tensor]:
    """(sum_t row_weights[t]·KL(target_t || draft_t), argmax draft ids) for h [n, H], weight [V, H]."""
    return _FusedLinearKL.apply(h, weight, target_logp, row_weights, chunk)


def reference_linear_kl(
    h: Tensor, weight: Tensor, target_logp: Tensor, row_weights: Tensor
) -> tuple[Tensor, Tensor]:
    """Plain-autograd twin of ``fused_linear_kl`` (tests compare the two)."""
    logits = h.float() @ weight.float().T
    logq = torch.log_softmax(logits, dim=-1)
    kl = (target_logp.exp() * (target_logp - logq)).sum(-1)
    return (kl * row_weights).sum(), logits.argmax(-1)


@dataclass
class StepCounts:
    """Raw counts of one TTT step, summable across batches and ranks before dividing."""

    loss: Tensor  # decayed, normalised step loss (what is optimised)
    kl_sum: Tensor  # sum of KL over scored slots
    scored: Tensor  # number of scored slots
    full_correct: Tensor  # scored slots whose steps 0..k all matched the target's argmax
    cond_total: Tensor  # slots whose steps 0..k-1 all matched (the condition)


def step_accuracy(
    preds: Tensor, target_ids: Tensor, valid: Tensor, in_doc: Tensor, prev_correct: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(full_correct, cond_total, new prev_correct) with speculators' definitions.

    prev_correct starts as the step-0 valid mask; a slot stays in it while every step so far
    predicted the target's argmax. full accuracy of step k = scored slots correct at steps
    0..k / scored slots; conditional accuracy = the same numerator / slots correct at steps
    0..k-1 — the chance the k-th draft token is accepted given the earlier ones were, i.e.
    the acceptance proxy.
    """
    cond_total = (prev_correct & in_doc).sum()
    now = prev_correct & in_doc & (preds == target_ids)
    full_correct = (now & valid).sum()
    return full_correct, cond_total, now


def unpack_stats(stats: Tensor) -> list[StepCounts]:
    """The rows of the model's stats tensor [ttt_steps, 5] (summed over batches/ranks)."""
    return [StepCounts(*row.unbind(0)) for row in stats.detach().cpu()]


def summarize(steps: list[StepCounts], num_batches: float = 1.0) -> dict[str, float]:
    """Ratios from (already summed) counts; names are what the logs and trackers show.

    ``num_batches``: how many batch losses the step losses are sums of (they are averaged).
    """
    out: dict[str, float] = {}
    accept = 1.0
    for k, s in enumerate(steps):
        scored = float(s.scored)
        out[f"loss_{k}"] = float(s.loss) / max(num_batches, 1.0)
        out[f"kl_{k}"] = float(s.kl_sum) / scored if scored else float("nan")
        out[f"full_acc_{k}"] = float(s.full_correct) / scored if scored else float("nan")
        cond = float(s.cond_total)
        out[f"cond_acc_{k}"] = float(s.full_correct) / cond if cond else float("nan")
        if scored:
            accept += float(s.full_correct) / scored
    # Expected tokens per draft-and-verify round under greedy acceptance (vLLM's
    # 1 + accepted/drafts), estimated from full accuracies.
    out["accept_len_proxy"] = accept
    return out
