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
    """Per TTT step: which token each slot is fed, and which slots are scored.

    Computed where the batch is (``align``); built on the host and moved with ``to``, its
    Python ints (document lengths, scored counts) keep the step free of host syncs."""

    doc_start: Tensor  # [T] long: first row of the slot's document
    positions: Tensor  # [T] long: position of slot t at step 0 (t - doc_start)
    step_tokens: list[Tensor]  # per step k: [T] long, x_{t+1+k} (0 past the end; never scored)
    in_doc: list[Tensor]  # per step k: [T] bool, t+1+k inside t's document
    valid: list[Tensor]  # per step k: [T] bool, in_doc & loss_mask[t+1+k]
    # per step k: the slots whose draft logits are formed — the scored ones, and those whose
    # step-0 row was scored (the accuracy chain of ``step_accuracy`` follows them)
    loss_rows: list[Tensor]
    num_scored: list[int]  # per step k: valid[k].sum()
    cu_seqlens: Tensor  # [n+1] int32, the kernels' document boundaries
    max_doc_len: int

    def to(self, device: torch.device) -> Alignment:
        def move(x: Tensor) -> Tensor:
            if x.device.type == "cpu" and torch.device(device).type == "cuda":
                x = x.pin_memory()  # non-blocking from pageable memory would stall the host
            return x.to(device, non_blocking=True)

        return Alignment(
            move(self.doc_start),
            move(self.positions),
            [move(x) for x in self.step_tokens],
            [move(x) for x in self.in_doc],
            [move(x) for x in self.valid],
            [move(x) for x in self.loss_rows],
            self.num_scored,
            move(self.cu_seqlens),
            self.max_doc_len,
        )


def document_bounds(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """doc_start [T] and doc_end [T] (exclusive) of every row of a packed sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    ends = torch.repeat_interleave(cu_seqlens[1:], lengths, output_size=total)
    return starts, ends


def align(input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, ttt_steps: int) -> Alignment:
    """The one shift (see the module docstring) for a packed, unshifted batch. Reads counts
    back to the host: call it on the host's copy of the batch, then ``Alignment.to``."""
    T = input_ids.shape[0]
    cu_seqlens = cu_seqlens.long()
    doc_start, doc_end = document_bounds(cu_seqlens, T)
    rows = torch.arange(T, device=input_ids.device)
    mask = loss_mask.bool()
    step_tokens, in_doc, valid, loss_rows, num_scored = [], [], [], [], []
    for k in range(ttt_steps):
        src = rows + 1 + k
        inside = src < doc_end
        safe = src.clamp(max=T - 1)
        step_tokens.append(torch.where(src < T, input_ids[safe], torch.zeros_like(input_ids)))
        in_doc.append(inside)
        valid.append(inside & mask[safe])
        loss_rows.append(torch.nonzero(valid[k] | (valid[0] & inside)).flatten())
        num_scored.append(int(valid[k].sum()))
    max_doc_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if T else 0
    return Alignment(
        doc_start,
        rows - doc_start,
        step_tokens,
        in_doc,
        valid,
        loss_rows,
        num_scored,
        cu_seqlens.to(torch.int32),
        max_doc_len,
    )


# bf16/fp16 GEMMs with a float32 result (cuBLAS accumulates in float32), torch >= 2.8 on CUDA
_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype") and hasattr(torch.ops.aten.addmm, "dtype")


def mm_f32(a: Tensor, b: Tensor, accumulate: Tensor | None = None) -> Tensor:
    """``accumulate + a @ b`` in float32 for float32 or half-precision ``a``, ``b``.

    Half-precision inputs run on the half-precision tensor cores with a float32 result
    (``mm.dtype``); where that op is missing (CPU), the exact emulation: the product of two
    half-precision numbers is exact in float32, so upcasting first gives the same sums."""
    if a.dtype in (torch.float16, torch.bfloat16):
        if a.is_cuda and _HAS_MM_OUT_DTYPE:
            if accumulate is None:
                return torch.mm(a, b, out_dtype=torch.float32)
            return torch.addmm(accumulate, a, b, out_dtype=torch.float32)
        a, b = a.float(), b.float()
    return a @ b if accumulate is None else torch.addmm(accumulate, a, b)


@dataclass(frozen=True)
class TargetTopK:
    """The target's top-k tokens of each row (train.objective.topk) and the weight of the
    cross-entropy against them, taken once per batch and indexed per TTT step."""

    logp: Tensor  # [n, k] float32, log p of the top-k tokens
    ids: Tensor  # [n, k] long, their draft-vocabulary ids
    weight: float

    @staticmethod
    def of(target_logp: Tensor, k: int, weight: float) -> TargetTopK | None:
        if not weight:
            return None
        logp, ids = target_logp.topk(min(k, target_logp.shape[-1]), dim=-1)
        return TargetTopK(logp, ids, weight)

    def __getitem__(self, rows: Tensor | slice) -> TargetTopK:
        return TargetTopK(self.logp[rows], self.ids[rows], self.weight)


DIVERGENCES = ("kl", "tv", "lk")  # train.objective.divergence


def kl_chunk(
    logits: Tensor,
    target_logp: Tensor,
    row_weights: Tensor,
    top_logp: Tensor | None = None,
    top_ids: Tensor | None = None,
    top_weight: float = 0.0,
    divergence: str = "kl",
    lk_eta: float = 3.0,
) -> tuple[Tensor, ...]:
    """One chunk's (sum_t w_t·L_t, sum_t w_t·KL_t, d/dz of the first, argmax z), float32, where
    L_t = D_t + top_weight · (-sum_{i in top-k(p_t)} p_ti log q_ti), KL_t = KL(p_t || q_t),
    q_t = softmax(z_t), and D_t the divergence:

    - ``kl``: KL_t. d/dz = q - p (p sums to one over the draft vocabulary).
    - ``tv``: TV_t = 1 - sum_i min(p_i, q_i), 1 - TV being the chance speculative sampling
      accepts the draft's token. With m_i = [q_i < p_i] and S = sum_i m_i q_i,
      d sum_i min(p_i, q_i) / dz_j = sum_i m_i q_i (δ_ij - q_j), so d TV / dz = q·(S - m).
    - ``lk``: the LK hybrid λ·KL + (1 - λ)·TV, λ = exp(-lk_eta·α) with α = 1 - TV held
      constant (no gradient through λ): KL's gradient while the draft is far from the target,
      the acceptance rate's once it is close.

    d top-k CE / d z = P_k·q - p·1_k with P_k the target's top-k mass. Plain torch, so
    ``compile_kl_chunk`` can fuse its elementwise passes into a few kernels."""
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
        top_p = top_logp.exp()
        loss = loss - top_weight * (top_p * logq.gather(-1, top_ids)).sum(-1)
        grad = grad + top_weight * top_p.sum(-1, keepdim=True) * q
        grad = grad.scatter_add(-1, top_ids, -top_weight * top_p)
    grad = grad * row_weights.unsqueeze(-1)
    return (loss * row_weights).sum(), (kl * row_weights).sum(), grad, logits.argmax(-1)


_kl_chunk_impl = kl_chunk


def compile_kl_chunk(enabled: bool) -> None:
    """Use a ``torch.compile``d chunk body (train.compile) or the eager one."""
    global _kl_chunk_impl
    _kl_chunk_impl = torch.compile(kl_chunk, dynamic=True) if enabled else kl_chunk


class _FusedLinearKL(torch.autograd.Function):
    """sum_t w_t · KL(p_t || softmax(h_t W^T)) with gradients formed chunk by chunk in forward.

    Draft logits exist one chunk at a time; the backward only rescales the stored gradients.
    The GEMMs take ``mm_dtype`` inputs (bf16 under autocast) with float32 results; softmax,
    KL and the gradients' accumulation are float32. Also returns the argmax of each row's
    draft logits (no gradient) for the metrics.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        h: Tensor,
        weight: Tensor,
        target_logp: Tensor,
        row_weights: Tensor,
        chunk: int,
        mm_dtype: torch.dtype,
        top: TargetTopK | None,
        divergence: tuple[str, float],
    ) -> tuple[Tensor, Tensor, Tensor]:
        with torch.autocast(h.device.type, enabled=False):  # the dtypes here are explicit
            return _FusedLinearKL._forward(
                ctx, h, weight, target_logp, row_weights, chunk, mm_dtype, top, divergence
            )

    @staticmethod
    def _forward(
        ctx: torch.autograd.function.FunctionCtx,
        h: Tensor,
        weight: Tensor,
        target_logp: Tensor,
        row_weights: Tensor,
        chunk: int,
        mm_dtype: torch.dtype,
        top: TargetTopK | None,
        divergence: tuple[str, float],
    ) -> tuple[Tensor, Tensor, Tensor]:
        n = h.shape[0]
        need_h = ctx.needs_input_grad[0]  # type: ignore[attr-defined]
        need_w = ctx.needs_input_grad[1]  # type: ignore[attr-defined]
        acc = torch.float64 if mm_dtype == torch.float64 else torch.float32
        w_mm = weight.to(mm_dtype)
        w_mm_t = w_mm.T
        grad_h = torch.empty(h.shape, dtype=acc, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=h.device) if need_w else None
        total = torch.zeros((), dtype=acc, device=h.device)
        kl_total = torch.zeros((), dtype=acc, device=h.device)
        preds = torch.empty(n, dtype=torch.long, device=h.device)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            hc = h[c0:c1].to(mm_dtype)
            top_c = (
                (top.logp[c0:c1].to(acc), top.ids[c0:c1], top.weight) if top else (None, None, 0.0)
            )
            part, kl_part, g, preds[c0:c1] = _kl_chunk_impl(
                mm_f32(hc, w_mm_t),
                target_logp[c0:c1].to(acc),
                row_weights[c0:c1].to(acc),
                *top_c,
                *divergence,
            )
            total += part
            kl_total += kl_part
            if need_h or need_w:
                g = g.to(mm_dtype)
                if grad_h is not None:
                    grad_h[c0:c1] = mm_f32(g, w_mm)
                if grad_w is not None:
                    grad_w = mm_f32(g.T, hc, accumulate=grad_w)
        ctx.save_for_backward(*(x for x in (grad_h, grad_w) if x is not None))
        ctx.has = (grad_h is not None, grad_w is not None)  # type: ignore[attr-defined]
        ctx.dtypes = (h.dtype, weight.dtype)  # type: ignore[attr-defined]
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
        has_h, has_w = ctx.has  # type: ignore[attr-defined]
        h_dtype, w_dtype = ctx.dtypes  # type: ignore[attr-defined]
        grad_h = (saved.pop(0) * grad_total).to(h_dtype) if has_h else None
        grad_w = (saved.pop(0) * grad_total).to(w_dtype) if has_w else None
        return grad_h, grad_w, None, None, None, None, None, None


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
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum_t w_t·L_t, sum_t w_t·KL_t, argmax draft ids) for h [n, H], weight [V, H] and
    w = ``row_weights``; KL_t = KL(target_t || draft_t), L_t the ``divergence`` (kl, tv or lk)
    plus, with ``top`` (the rows of ``target_logp``'s top-k), its weight times the
    cross-entropy against the target's top-k tokens (``kl_chunk``). Only the first has a
    gradient.

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
    return _FusedLinearKL.apply(
        h, weight, target_logp, row_weights, chunk, mm_dtype, top, (divergence, lk_eta)
    )


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
    """Plain-autograd twin of ``fused_linear_kl`` (tests compare the two; the top-k term and
    the divergences from their definitions, without ``TargetTopK`` or hand-made gradients).
    float32, float64 for float64 inputs."""
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
