"""Training-time-test attention: causal + document keys of step 0, plus each slot's own keys
from later TTT steps (the "diagonal").

At TTT step ``k`` the query of slot ``t`` attends to

- the step-0 keys of slots ``doc_start[t] .. t`` (causal, inside its own packed document), and
- its *own* keys from steps ``1 .. k`` (one key per step, same slot).

This is exactly what vLLM's draft KV cache holds when it proposes token ``k+1`` of a chain:
the context's step-0 entries plus the chain's own earlier draft entries.

Two reference implementations with identical results (tests compare them, and both with a dense
float64 reference):

- ``chunked_ttt_attention``: a flash-style autograd function in plain torch. Queries are
  processed in chunks; each chunk only looks at keys from its first document start to its
  end (the causal + document block structure), keeps O and the log-sum-exp, and recomputes
  probabilities in backward. Memory O(T·chunk), work about half of T² per step.
- ``dense_ttt_attention``: one boolean mask over [step-0 keys | diagonal keys] and
  ``torch.nn.functional.scaled_dot_product_attention``, the layout speculators uses. Fused
  kernels on GPU; O(T²·(k+1)) work.

The GPU path, ``flash_ttt_attention``, is in flash_attention.py; it is checked against
``chunked_ttt_attention``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32; float32/float64 stay as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


_Step = TypeVar("_Step", bound=Callable)


def autocast_off(step: _Step) -> _Step:
    """An autograd Function's forward or backward run with autocast off on the device of its
    first tensor argument: the dtypes inside are explicit, and softmax statistics must come from
    the same precision in forward and backward."""

    @functools.wraps(step)
    def run(ctx: torch.autograd.function.FunctionCtx, first: Tensor, *rest: object) -> object:
        with torch.autocast(first.device.type, enabled=False):
            return step(ctx, first, *rest)

    return run  # type: ignore[return-value]


# bf16/fp16 GEMMs with a float32 result (cuBLAS accumulates in float32), torch >= 2.8 on CUDA
def _has_out_dtype(*ops: str) -> bool:
    return all(hasattr(getattr(torch.ops.aten, op), "dtype") for op in ops)


_OUT_DTYPE = {False: _has_out_dtype("mm", "addmm"), True: _has_out_dtype("bmm", "baddbmm")}


MM_F32_EMULATION = "mm_f32: bf16 inputs upcast (CPU; on CUDA the GEMM's out_dtype)"


def mm_f32(a: Tensor, b: Tensor, accumulate: Tensor | None = None) -> Tensor:
    """``accumulate + a @ b`` in float32 for float32 or half-precision ``a``, ``b`` (2-D, or
    3-D batches), float64 for float64 ones.

    Half-precision inputs run on the half-precision tensor cores with a float32 result
    (``mm.dtype``); where that op is missing (CPU), the exact emulation: the product of two
    half-precision numbers is exact in float32, so upcasting first gives the same sums."""
    batched = a.dim() == 3
    if a.dtype in (torch.float16, torch.bfloat16):
        if a.is_cuda and _OUT_DTYPE[batched]:
            f32 = torch.float32
            if accumulate is None:
                return (torch.bmm if batched else torch.mm)(a, b, out_dtype=f32)
            if batched:  # not baddbmm: its out_dtype overload's decomposition multiplies by the
                # dtype (torch 2.14), failing under torch.compile and fake tensors alike
                return torch.bmm(a, b, out_dtype=f32).add_(accumulate)
            return torch.addmm(accumulate, a, b, out_dtype=f32)
        with torch.profiler.record_function(MM_F32_EMULATION):  # named in profiles
            a, b = a.float(), b.float()
    if accumulate is None:
        return a @ b
    return (torch.baddbmm if batched else torch.addmm)(accumulate, a, b)


def _chunk_mask(doc_start: Tensor, c0: int, c1: int, k_lo: int) -> Tensor:
    """[C, L] bool: key j (absolute k_lo + col) is visible to query t (c0 + row)."""
    t = torch.arange(c0, c1, device=doc_start.device)
    j = torch.arange(k_lo, c1, device=doc_start.device)
    return (j[None, :] >= doc_start[c0:c1, None]) & (j[None, :] <= t[:, None])


class _ChunkedTTTAttention(torch.autograd.Function):
    """q [nkv, g, T, d]; k0, v0 [nkv, T, d]; kd, vd [m, nkv, T, d]; doc_start [T] long."""

    @staticmethod
    @autocast_off  # the math runs in float32 (bf16 autocast on GPU stays off)
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k0: Tensor,
        v0: Tensor,
        kd: Tensor,
        vd: Tensor,
        doc_start: Tensor,
        scale: float,
        chunk: int,
    ) -> Tensor:
        nkv, g, T, _ = q.shape
        m = kd.shape[0]
        cdt = compute_dtype(q.dtype)
        out = torch.empty((*q.shape[:-1], v0.shape[-1]), dtype=cdt, device=q.device)
        lse = torch.empty((nkv, g, T), dtype=cdt, device=q.device)
        starts = doc_start.tolist() if T else []
        qs = q.to(cdt) * scale  # scaled once: no pass over the scores for it
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            k_lo = starts[c0]  # documents are contiguous: the chunk's earliest visible key
            qc = qs[:, :, c0:c1]
            kr = k0[:, k_lo:c1].to(cdt).unsqueeze(1)  # [nkv, 1, L, d]
            vr = v0[:, k_lo:c1].to(cdt).unsqueeze(1)
            s = torch.matmul(qc, kr.transpose(-1, -2))  # [nkv, g, C, L]
            s.masked_fill_(~_chunk_mask(doc_start, c0, c1, k_lo), float("-inf"))
            mx = s.amax(dim=-1)  # the diagonal key j = t is always visible: finite
            if m:
                kdc = kd[:, :, None, c0:c1].to(cdt)  # [m, nkv, 1, C, d]
                sd = (qc.unsqueeze(0) * kdc).sum(-1)  # [m, nkv, g, C]
                mx = torch.maximum(mx, sd.amax(dim=0))
            p = s.sub_(mx.unsqueeze(-1)).exp_()  # in place: the scores are not needed again
            z = p.sum(-1)
            o = torch.matmul(p, vr)  # [nkv, g, C, d]
            if m:
                pd = torch.exp(sd - mx)
                z = z + pd.sum(0)
                o = o + (pd.unsqueeze(-1) * vd[:, :, None, c0:c1].to(cdt)).sum(0)
            out[:, :, c0:c1] = o / z.unsqueeze(-1)
            lse[:, :, c0:c1] = mx + torch.log(z)
        ctx.save_for_backward(q, k0, v0, kd, vd, doc_start, out, lse)
        ctx.scale, ctx.chunk = scale, chunk
        return out.to(q.dtype)

    @staticmethod
    @autocast_off
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor):  # type: ignore[override]
        q, k0, v0, kd, vd, doc_start, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        scale, chunk = ctx.scale, ctx.chunk  # type: ignore[attr-defined]
        T = q.shape[2]
        m = kd.shape[0]
        cdt = compute_dtype(q.dtype)
        dq = torch.empty(q.shape, dtype=cdt, device=q.device)
        dk0 = torch.zeros(k0.shape, dtype=cdt, device=q.device)
        dv0 = torch.zeros(v0.shape, dtype=cdt, device=q.device)
        dkd = torch.empty(kd.shape, dtype=cdt, device=q.device)  # chunks write disjoint rows
        dvd = torch.empty(vd.shape, dtype=cdt, device=q.device)
        starts = doc_start.tolist() if T else []
        qs = q.to(cdt) * scale
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            k_lo = starts[c0]
            qc = qs[:, :, c0:c1]
            kr = k0[:, k_lo:c1].to(cdt).unsqueeze(1)
            vr = v0[:, k_lo:c1].to(cdt).unsqueeze(1)
            do = grad_out[:, :, c0:c1].to(cdt)
            lc = lse[:, :, c0:c1]
            delta = (do * out[:, :, c0:c1]).sum(-1)  # [nkv, g, C]
            s = torch.matmul(qc, kr.transpose(-1, -2))
            s.masked_fill_(~_chunk_mask(doc_start, c0, c1, k_lo), float("-inf"))
            p = s.sub_(lc.unsqueeze(-1)).exp_()  # masked entries are exactly 0
            dv0[:, k_lo:c1] += torch.matmul(p.transpose(-1, -2), do).sum(1)
            ds = torch.matmul(do, vr.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(p)
            dqc = torch.matmul(ds, kr).mul_(scale)
            dk0[:, k_lo:c1] += torch.matmul(ds.transpose(-1, -2), qc).sum(1)  # qc carries scale
            if m:
                kdc = kd[:, :, None, c0:c1].to(cdt)
                vdc = vd[:, :, None, c0:c1].to(cdt)
                sd = (qc.unsqueeze(0) * kdc).sum(-1)
                pd = torch.exp(sd - lc)  # [m, nkv, g, C]
                dpd = (do.unsqueeze(0) * vdc).sum(-1)
                dsd = pd * (dpd - delta)
                dqc = dqc + (dsd.unsqueeze(-1) * kdc).sum(0) * scale
                dkd[:, :, c0:c1] = (dsd.unsqueeze(-1) * qc.unsqueeze(0)).sum(2)
                dvd[:, :, c0:c1] = (pd.unsqueeze(-1) * do.unsqueeze(0)).sum(2)
            dq[:, :, c0:c1] = dqc
        return (
            dq.to(q.dtype),
            dk0.to(k0.dtype),
            dv0.to(v0.dtype),
            dkd.to(kd.dtype),
            dvd.to(vd.dtype),
            None,
            None,
            None,
        )


def chunked_ttt_attention(
    q: Tensor,
    k0: Tensor,
    v0: Tensor,
    kd: Tensor,
    vd: Tensor,
    doc_start: Tensor,
    chunk: int = 512,
    scale: float | None = None,
) -> Tensor:
    """Attention output [nh, T, dv] for queries q [nh, T, d] (heads grouped over kv heads).

    k0 [nkv, T, d], v0 [nkv, T, dv]: step-0 keys/values (MLA's values are narrower than its
    keys). kd, vd [m, nkv, T, ·]: this slot's keys/values of TTT steps 1..m (m = 0 at step 0).
    doc_start [T]: first row of each row's document.
    """
    nh, T, d = q.shape
    nkv = k0.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = _ChunkedTTTAttention.apply(
        q.reshape(nkv, nh // nkv, T, d), k0, v0, kd, vd, doc_start, scale, chunk
    )
    return out.reshape(nh, T, v0.shape[-1])


def ttt_mask(doc_start: Tensor, num_diag: int) -> Tensor:
    """Boolean [T, (1 + num_diag)·T]: causal+document block, then one diagonal per step."""
    T = doc_start.shape[0]
    idx = torch.arange(T, device=doc_start.device)
    main = (idx[None, :] >= doc_start[:, None]) & (idx[None, :] <= idx[:, None])
    diag = torch.eye(T, dtype=torch.bool, device=doc_start.device)
    return torch.cat([main] + [diag] * num_diag, dim=1)


def dense_ttt_attention(
    q: Tensor,
    k0: Tensor,
    v0: Tensor,
    kd: Tensor,
    vd: Tensor,
    doc_start: Tensor,
    scale: float | None = None,
) -> Tensor:
    """Same contract as ``chunked_ttt_attention``, through torch's SDPA with a dense mask."""
    nh, _, d = q.shape
    nkv = k0.shape[0]
    keys = torch.cat([k0.unsqueeze(0), kd], dim=0)  # [1+m, nkv, T, d]
    values = torch.cat([v0.unsqueeze(0), vd], dim=0)
    keys = keys.permute(1, 0, 2, 3).reshape(nkv, -1, d)
    values = values.permute(1, 0, 2, 3).reshape(nkv, -1, v0.shape[-1])
    if nkv != nh:
        keys = keys.repeat_interleave(nh // nkv, dim=0)
        values = values.repeat_interleave(nh // nkv, dim=0)
    mask = ttt_mask(doc_start, kd.shape[0])
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scale
    )
    return out.squeeze(0)
