"""The TTT loss over the draft vocabulary (forward KL, TV, the LK hybrid, the HASS top-k
term), formed chunk by chunk with its gradients, and the per-step metrics.

Which slot is trained toward which target row is ``shift.align``'s (THE shift); this module
takes its rows as given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eagle3_train.model.attention import autocast_off, mm_f32

LOSS_EPS = 1e-5  # added to each step's loss denominator, as speculators does
# The LM head's weight gradient is one GEMM over many chunks' rows: their d/dz (in the GEMM's
# input dtype) are held until they reach this many elements (512 MiB in bf16), then multiplied
# into the float32 [V, H] gradient at once. A GEMM per chunk would read and write that
# gradient once per chunk (0.9 GB each way at the Kimi-K2.5 draft's shape).
HEAD_GRAD_ROWS_ELEMENTS = 1 << 28


@dataclass(frozen=True)
class TargetTopK:
    """The target's top-k tokens of each row (train.objective.topk) and the weight of the
    cross-entropy against them, taken once per batch; the loss loop gathers its rows."""

    logp: Tensor  # [n, k] float32, log p of the top-k tokens
    ids: Tensor  # [n, k] long, their draft-vocabulary ids
    weight: float

    @staticmethod
    def of(target_logp: Tensor, k: int, weight: float) -> TargetTopK | None:
        if not weight:
            return None
        logp, ids = target_logp.topk(min(k, target_logp.shape[-1]), dim=-1)
        return TargetTopK(logp, ids, weight)


DIVERGENCES = ("kl", "tv", "lk")  # train.objective.divergence


def _normalized(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x·rstd, rstd) of RMSNorm, in float32 (as ``layers.RMSNorm``, float64 x included)."""
    x = x.float()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * rstd, rstd


def head_rows(
    x: Tensor, rows: Tensor, norm_weight: Tensor | None, eps: float, dtype: torch.dtype
) -> Tensor:
    """The LM head's input for one chunk: rows ``rows`` of ``x``, RMS-normed when
    ``norm_weight`` is given (as ``layers.RMSNorm``: normalised in float32, rounded to x's
    dtype, times the weight), in the GEMM's ``dtype``. Gathered and normed a chunk at a
    time, no [n, H] copy of the normed rows exists."""
    xc = x[rows]
    if norm_weight is not None:
        xc = norm_weight * _normalized(xc, eps)[0].to(x.dtype)
    return xc.to(dtype)


def head_rows_backward(
    grad: Tensor, x: Tensor, rows: Tensor, norm_weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """Through ``head_rows``' norm, in ``grad``'s dtype: (d/dx of the chunk's rows, the
    chunk's share of d/d norm_weight). With y = x·rstd: d/dw = sum_t grad·y, and for
    dy = grad·w, d/dx = rstd·(dy - y·mean(dy·y))."""
    y, rstd = _normalized(x[rows], eps)
    y, rstd = y.to(grad.dtype), rstd.to(grad.dtype)
    grad_w = (grad * y.to(x.dtype).to(grad.dtype)).sum(0)  # the rounded y the forward used
    dy = grad * norm_weight.to(grad.dtype)
    return rstd * (dy - y * (dy * y).mean(-1, keepdim=True)), grad_w


def kl_chunk(
    logits: Tensor,
    target_logp: Tensor,
    target_rows: Tensor,
    row_weights: Tensor,
    grad_dtype: torch.dtype,
    top_logp: Tensor | None = None,
    top_ids: Tensor | None = None,
    top_weight: float = 0.0,
    divergence: str = "kl",
    lk_eta: float = 3.0,
) -> tuple[Tensor, ...]:
    """One chunk's (sum_t w_t·L_t, sum_t w_t·KL_t, d/dz of the first in ``grad_dtype``,
    argmax z): the losses float32, where L_t = D_t + top_weight · (-sum_{i in top-k(p_t)}
    p_ti log q_ti), KL_t = KL(p_t || q_t), q_t = softmax(z_t), p_t the target's row
    ``target_rows[t]`` (gathered here, a chunk at a time), and D_t the divergence:

    - ``kl``: KL_t. d/dz = q - p (p sums to one over the draft vocabulary).
    - ``tv``: TV_t = 1 - sum_i min(p_i, q_i), 1 - TV being the chance speculative sampling
      accepts the draft's token. With m_i = [q_i < p_i] and S = sum_i m_i q_i,
      d sum_i min(p_i, q_i) / dz_j = sum_i m_i q_i (δ_ij - q_j), so d TV / dz = q·(S - m).
    - ``lk``: the LK hybrid λ·KL + (1 - λ)·TV, λ = exp(-lk_eta·α) with α = 1 - TV held
      constant (no gradient through λ): KL's gradient while the draft is far from the target,
      the acceptance rate's once it is close.

    d top-k CE / d z = P_k·q - p·1_k with P_k the target's top-k mass. The softmax and the
    sums are float32; d/dz leaves in the backward GEMM's input dtype (bf16 under autocast:
    it is rounded there anyway), the rounding fused into the same pass. Plain torch, so
    ``compile_kl_chunk`` can fuse its elementwise passes into a few kernels."""
    target_logp = target_logp[target_rows].to(logits.dtype)
    logq = torch.log_softmax(logits, dim=-1)
    p = target_logp.exp()
    q = logq.exp()
    kl = (p * (target_logp - logq)).sum(-1)
    loss, grad = kl, q - p
    if divergence != "kl":
        below = q < p
        covered = torch.where(below, q, 0.0).sum(-1, keepdim=True)  # S
        tv = 1 - (covered.squeeze(-1) + torch.where(below, 0.0, p).sum(-1))
        tv_grad = q * (covered - below.to(q.dtype))
        if divergence == "tv":
            loss, grad = tv, tv_grad
        else:
            lam = torch.exp(-lk_eta * (1 - tv))
            loss = lam * kl + (1 - lam) * tv
            lam = lam.unsqueeze(-1)
            grad = lam * grad + (1 - lam) * tv_grad
    if top_logp is not None and top_ids is not None:
        top_p = top_logp[target_rows].to(logits.dtype).exp()
        ids = top_ids[target_rows]
        loss = loss - top_weight * (top_p * logq.gather(-1, ids)).sum(-1)
        grad = grad + top_weight * top_p.sum(-1, keepdim=True) * q
        grad = grad.scatter_add(-1, ids, -top_weight * top_p)
    row_weights = row_weights.to(logits.dtype)
    grad = (grad * row_weights.unsqueeze(-1)).to(grad_dtype)
    return (loss * row_weights).sum(), (kl * row_weights).sum(), grad, logits.argmax(-1)


_head_rows_impl, _kl_chunk_impl, _head_rows_backward_impl = head_rows, kl_chunk, head_rows_backward


def compile_kl_chunk(enabled: bool) -> None:
    """Use ``torch.compile``d chunk bodies (train.compile) or the eager ones: the rows'
    gather and final norm, the chunk's softmax and KL, the norm's backward."""
    global _head_rows_impl, _kl_chunk_impl, _head_rows_backward_impl
    bodies = (head_rows, kl_chunk, head_rows_backward)
    if enabled:
        bodies = tuple(torch.compile(f, dynamic=True) for f in bodies)
    _head_rows_impl, _kl_chunk_impl, _head_rows_backward_impl = bodies


class _FusedLinearKL(torch.autograd.Function):
    """sum_t w_t · KL(p_t || softmax(h_t W^T)) with gradients formed chunk by chunk in forward.

    The rows of h (gathered, RMS-normed) and the draft logits exist one chunk at a time; the
    backward only rescales the stored gradients. The GEMMs take ``mm_dtype`` inputs (bf16
    under autocast) with float32 results; softmax, KL and the gradients' accumulation are
    float32. Also returns the argmax of each row's draft logits (no gradient) for the metrics.
    """

    @staticmethod
    @autocast_off  # the dtypes here are explicit
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        weight: Tensor,
        norm_weight: Tensor | None,
        target_logp: Tensor,
        row_weights: Tensor,
        rows: Tensor,
        target_offset: int,
        norm_eps: float,
        chunk: int,
        mm_dtype: torch.dtype,
        top: TargetTopK | None,
        divergence: tuple[str, float],
    ) -> tuple[Tensor, Tensor, Tensor]:
        n = rows.shape[0]
        need_x, need_w, need_nw = ctx.needs_input_grad[:3]  # type: ignore[attr-defined]
        acc = torch.float64 if mm_dtype == torch.float64 else torch.float32
        w_mm = weight.to(mm_dtype)
        w_mm_t = w_mm.T
        # rows not scored get no gradient; the scored ones' are written chunk by chunk
        grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
        grad_w: Tensor | None = None  # the first flush of ``head_rows`` writes it
        head_rows: list[tuple[Tensor, Tensor]] = []  # (d/dz, normed rows) not yet in grad_w
        held = 0
        grad_nw = None
        if need_nw and norm_weight is not None:
            grad_nw = torch.zeros(norm_weight.shape, dtype=acc, device=x.device)
        total = torch.zeros((), dtype=acc, device=x.device)
        kl_total = torch.zeros((), dtype=acc, device=x.device)
        preds = torch.empty(n, dtype=torch.long, device=x.device)
        top_c = (top.logp, top.ids, top.weight) if top else (None, None, 0.0)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            rows_c = rows[c0:c1]
            hc = _head_rows_impl(x, rows_c, norm_weight, norm_eps, mm_dtype)
            part, kl_part, g, preds[c0:c1] = _kl_chunk_impl(
                mm_f32(hc, w_mm_t),
                target_logp,
                rows_c + target_offset,
                row_weights[c0:c1],
                mm_dtype,
                *top_c,
                *divergence,
            )
            total += part
            kl_total += kl_part
            if need_w:
                head_rows.append((g, hc))
                held += g.numel()
                if held >= HEAD_GRAD_ROWS_ELEMENTS:
                    grad_w = _head_weight_grad(head_rows, grad_w)
                    head_rows, held = [], 0
            if grad_x is not None or grad_nw is not None:
                grad_h = mm_f32(g, w_mm)
                if norm_weight is not None:
                    grad_h, grad_nw_c = _head_rows_backward_impl(
                        grad_h, x, rows_c, norm_weight, norm_eps
                    )
                    if grad_nw is not None:
                        grad_nw += grad_nw_c
                if grad_x is not None:
                    grad_x[rows_c] = grad_h
        if head_rows:
            grad_w = _head_weight_grad(head_rows, grad_w)
        if need_w and grad_w is None:  # no row scored
            grad_w = torch.zeros(weight.shape, dtype=acc, device=x.device)
        grads = (grad_x, grad_w, grad_nw)
        ctx.save_for_backward(*(g for g in grads if g is not None))
        ctx.has = tuple(g is not None for g in grads)  # type: ignore[attr-defined]
        ctx.dtypes = (x.dtype, weight.dtype, None if norm_weight is None else norm_weight.dtype)  # type: ignore[attr-defined]
        ctx.mark_non_differentiable(kl_total, preds)
        if acc == torch.float32:
            total, kl_total = total.float(), kl_total.float()
        return total, kl_total, preds

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        grad_total: Tensor,
        _grad_kl: Tensor,
        _grad_preds: Tensor,
    ):
        saved = list(ctx.saved_tensors)  # type: ignore[attr-defined]
        grads = [
            (saved.pop(0) * grad_total).to(dtype) if has else None
            for has, dtype in zip(ctx.has, ctx.dtypes, strict=True)  # type: ignore[attr-defined]
        ]
        return (*grads, None, None, None, None, None, None, None, None, None)


def _head_weight_grad(head_rows: list[tuple[Tensor, Tensor]], grad_w: Tensor | None) -> Tensor:
    """grad_w + Σ gᵀ·h over the held chunks, as one GEMM (float32 result and accumulation)."""
    g = torch.cat([g for g, _ in head_rows]) if len(head_rows) > 1 else head_rows[0][0]
    h = torch.cat([h for _, h in head_rows]) if len(head_rows) > 1 else head_rows[0][1]
    return mm_f32(g.T, h, accumulate=grad_w)


def fused_linear_kl(
    h: Tensor,
    weight: Tensor,
    target_logp: Tensor,
    row_weights: Tensor,
    chunk: int = 1024,
    mm_dtype: torch.dtype | None = None,
    top: TargetTopK | None = None,
    divergence: str = "kl",
    lk_eta: float = 3.0,
    rows: Tensor | None = None,
    target_offset: int = 0,
    norm: tuple[Tensor, float] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum_t w_t·L_t, sum_t w_t·KL_t, argmax draft ids) over the rows ``rows`` of h [T, H]
    (default: all), with weight [V, H], w = ``row_weights`` (one per row of ``rows``) and the
    target of row t = ``target_logp[t + target_offset]``; KL_t = KL(target_t || draft_t), L_t
    the ``divergence`` (kl, tv or lk) plus, with ``top`` (``target_logp``'s top-k, indexed
    alike), its weight times the cross-entropy against the target's top-k tokens
    (``kl_chunk``). ``norm`` = (weight, eps): the rows are RMS-normed first (the draft's
    final norm, applied chunk by chunk; its weight gets a gradient). Only the first result
    has a gradient.

    ``mm_dtype``: the GEMMs' input dtype; default: autocast's dtype where autocast is on
    (bf16 on CUDA), else float32 (float64 for float64 inputs)."""
    if mm_dtype is None:
        device = h.device.type
        if torch.is_autocast_enabled(device):
            mm_dtype = torch.get_autocast_dtype(device)
        else:
            mm_dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence {divergence!r}: expected one of {', '.join(DIVERGENCES)}")
    if rows is None:
        rows = torch.arange(h.shape[0], device=h.device)
    norm_weight, eps = norm if norm is not None else (None, 0.0)
    return _FusedLinearKL.apply(
        h, weight, norm_weight, target_logp, row_weights, rows, target_offset, eps, chunk,
        mm_dtype, top, (divergence, lk_eta),
    )  # fmt: skip


@dataclass
class StepCounts:
    """Raw counts of one TTT step, summable across batches and ranks before dividing."""

    loss: Tensor  # decayed, normalised step loss (what is optimised)
    kl_sum: Tensor  # sum of KL over scored slots
    scored: Tensor  # number of scored slots
    full_correct: Tensor  # scored slots whose steps 0..k all matched the target's argmax
    cond_total: Tensor  # slots whose steps 0..k-1 all matched (the condition)


NUM_STATS = len(StepCounts.__dataclass_fields__)  # columns of the model's stats tensor


def step_accuracy(
    correct: Tensor, valid: Tensor, in_doc: Tensor, prev_correct: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """(full_correct, cond_total, new prev_correct) with speculators' definitions.

    ``correct``: the draft's argmax equals the target's at this step (rows without draft
    logits are False: they are neither scored nor in the chain). prev_correct starts as the
    step-0 valid mask; a slot stays in it while every step so far predicted the target's
    argmax. full accuracy of step k = scored slots correct at steps 0..k / scored slots;
    conditional accuracy = the same numerator / slots correct at steps 0..k-1 — the chance
    the k-th draft token is accepted given the earlier ones were, i.e. the acceptance proxy.
    """
    cond_total = (prev_correct & in_doc).sum()
    now = prev_correct & in_doc & correct
    full_correct = (now & valid).sum()
    return full_correct, cond_total, now


def unpack_stats(stats: Tensor) -> list[StepCounts]:
    """The rows of the model's stats tensor [ttt_steps, NUM_STATS] (summed over batches/ranks)."""
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
