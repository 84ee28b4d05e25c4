"""Training-time-test attention: causal + document keys of step 0, plus each slot's own keys
from later TTT steps (the "diagonal").

At TTT step ``k`` the query of slot ``t`` attends to

- the step-0 keys of slots ``doc_start[t] .. t`` (causal, inside its own packed document), and
- its *own* keys from steps ``1 .. k`` (one key per step, same slot).

This is exactly what vLLM's draft KV cache holds when it proposes token ``k+1`` of a chain:
the context's step-0 entries plus the chain's own earlier draft entries.

Two implementations with identical results (tests compare them, and both with a dense
float64 reference):

- ``chunked_ttt_attention``: a flash-style autograd function in plain torch. Queries are
  processed in chunks; each chunk only looks at keys from its first document start to its
  end (the causal + document block structure), keeps O and the log-sum-exp, and recomputes
  probabilities in backward. Memory O(T·chunk), work about half of T² per step.
- ``dense_ttt_attention``: one boolean mask over [step-0 keys | diagonal keys] and
  ``torch.nn.functional.scaled_dot_product_attention``, the layout speculators uses. Fused
  kernels on GPU; O(T²·(k+1)) work.
- ``flash_ttt_attention``: the GPU path. FlashAttention-2 varlen (the kernel torch ships,
  ``aten::_flash_attention_forward``) over the document-causal step-0 keys returns the
  output and its log-sum-exp; the diagonal keys (one score per slot and step) are merged in
  closed form. The backward calls the kernel's backward with the *merged* output and
  log-sum-exp, which is exactly the full softmax's gradient for the step-0 keys, and forms
  the diagonal keys' gradients in closed form. On CPU the same structure runs on torch's
  CPU flash kernel with a document-causal mask (how the tests check it without a GPU).

``resolve_attention`` picks the path of ``draft.attention: auto``: flash on CUDA in bf16 or
fp16 (the kernel's dtypes) where the kernel exists, the chunked reference otherwise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs are computed in float32; float32/float64 stay as they are."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _chunk_mask(doc_start: Tensor, c0: int, c1: int, k_lo: int) -> Tensor:
    """[C, L] bool: key j (absolute k_lo + col) is visible to query t (c0 + row)."""
    t = torch.arange(c0, c1, device=doc_start.device)
    j = torch.arange(k_lo, c1, device=doc_start.device)
    return (j[None, :] >= doc_start[c0:c1, None]) & (j[None, :] <= t[:, None])


class _ChunkedTTTAttention(torch.autograd.Function):
    """q [nkv, g, T, d]; k0, v0 [nkv, T, d]; kd, vd [m, nkv, T, d]; doc_start [T] long."""

    @staticmethod
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
        # Softmax statistics must come from the same precision in forward and backward:
        # autocast (bf16 on GPU) stays off inside, the math runs in float32.
        with torch.autocast(q.device.type, enabled=False):
            return _ChunkedTTTAttention._forward(ctx, q, k0, v0, kd, vd, doc_start, scale, chunk)

    @staticmethod
    def _forward(
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
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor):  # type: ignore[override]
        with torch.autocast(grad_out.device.type, enabled=False):
            return _ChunkedTTTAttention._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor):
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


# ---------------------------------------------------------------------------------------
# The GPU path: FlashAttention varlen over the step-0 keys + the diagonal keys in closed form

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_kernel_available(device: torch.device) -> bool:
    """The kernel this path calls exists for ``device`` in the installed torch."""
    if device.type == "cuda":
        return hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(
            torch.ops.aten, "_flash_attention_backward"
        )
    return device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def resolve_attention(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → "flash" on CUDA for half-precision compute where the kernel exists, else
    "chunked" (the exact reference; CPU). Explicit choices are returned as they are."""
    if impl != "auto":
        return impl
    if device.type == "cuda" and dtype in FLASH_DTYPES and flash_kernel_available(device):
        return "flash"
    return "chunked"


def _doc_causal_bias(cu_seqlens: Tensor, T: int, dtype: torch.dtype) -> Tensor:
    """Additive [T, T] mask (0 visible, -inf hidden) of the document-causal step-0 keys."""
    doc_start = torch.repeat_interleave(
        cu_seqlens[:-1].long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long(), output_size=T
    )
    idx = torch.arange(T, device=cu_seqlens.device)
    visible = (idx[None, :] >= doc_start[:, None]) & (idx[None, :] <= idx[:, None])
    bias = torch.zeros((T, T), dtype=dtype, device=cu_seqlens.device)
    return bias.masked_fill_(~visible, float("-inf"))


def _kernel_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, scale: float
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
    """Document-causal attention of q [T, nh, d] over k, v [T, nkv, d]:
    (out [T, nh, d], lse [nh, T] float32, what the backward needs)."""
    T, nh, _ = q.shape
    if q.device.type == "cuda":
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
        )
        return out, lse, (rng, unused)
    # CPU: torch's flash kernel takes [B, heads, T, d], no GQA and a dense additive mask
    group = nh // k.shape[1]
    bias = _doc_causal_bias(cu_seqlens, T, q.dtype)
    qb, kb, vb = (
        x.transpose(0, 1).repeat_interleave(r, dim=0).unsqueeze(0)
        for x, r in ((q, 1), (k, group), (v, group))
    )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qb, kb, vb, 0.0, False, attn_mask=bias, scale=scale
    )
    return out[0].transpose(0, 1), lse[0].to(compute_dtype(q.dtype)), (bias,)


def _kernel_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_len: int,
    scale: float,
    aux: tuple[Tensor, ...],
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v for the attention whose output and log-sum-exp are ``out`` and
    ``lse`` — which may include keys the kernel does not see (the merge)."""
    if q.device.type == "cuda":
        rng, unused = aux
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_len, max_len,
            0.0, True, rng, unused, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    (bias,) = aux
    T, nh, _ = q.shape
    nkv = k.shape[1]
    group = nh // nkv
    qb, kb, vb, gb, ob = (
        x.transpose(0, 1).repeat_interleave(r, dim=0).unsqueeze(0)
        for x, r in ((q, 1), (k, group), (v, group), (grad_out, 1), (out, 1))
    )
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        gb, qb, kb, vb, ob, lse[None],
        0.0, False, attn_mask=bias, scale=scale,
    )  # fmt: skip

    def heads_to_kv(x: Tensor) -> Tensor:  # [1, nh, T, ·] summed over each kv head's group
        return x[0].view(nkv, group, T, -1).sum(1).transpose(0, 1)

    return dq[0].transpose(0, 1), heads_to_kv(dk), heads_to_kv(dv)


def _diagonal_scores(q: Tensor, kd: Tensor, scale: float) -> Tensor:
    """[m, T, nkv, g] float32 scores of each slot's query against its own later-step keys;
    q [T, nkv, g, d] and kd [m, T, nkv, d] (float32)."""
    return torch.einsum("tkgd,mtkd->mtkg", q, kd) * scale


class _FlashTTTAttention(torch.autograd.Function):
    """q [T, nh, d]; k0, v0 [T, nkv, d]; kd, vd [m, T, nkv, d] (v widths padded to d)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        q: Tensor,
        k0: Tensor,
        v0: Tensor,
        kd: Tensor,
        vd: Tensor,
        cu_seqlens: Tensor,
        max_len: int,
        scale: float,
    ) -> Tensor:
        T, nh, d = q.shape
        nkv = k0.shape[1]
        g = nh // nkv
        cdt = compute_dtype(q.dtype)
        out0, lse0, aux = _kernel_forward(q, k0, v0, cu_seqlens, max_len, scale)
        # merge: softmax over [step-0 keys | diagonal keys] from lse0 and the diagonal scores
        qf = q.to(cdt).view(T, nkv, g, d)
        s = _diagonal_scores(qf, kd.to(cdt), scale)  # [m, T, nkv, g]
        lse0_t = lse0.view(nkv, g, T).permute(2, 0, 1)  # [T, nkv, g]
        lse = torch.logsumexp(torch.cat([lse0_t.unsqueeze(0), s]), dim=0)
        w0 = torch.exp(lse0_t - lse).unsqueeze(-1)
        p = torch.exp(s - lse)
        out = w0 * out0.to(cdt).view(T, nkv, g, -1) + torch.einsum("mtkg,mtkd->tkgd", p, vd.to(cdt))
        out = out.reshape(T, nh, -1).to(q.dtype)
        lse_kernel = lse.permute(1, 2, 0).reshape(nh, T).contiguous()  # the kernel's layout
        ctx.save_for_backward(q, k0, v0, kd, vd, cu_seqlens, out, lse_kernel, *aux)
        ctx.max_len, ctx.scale = max_len, scale  # type: ignore[attr-defined]
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor):  # type: ignore[override]
        q, k0, v0, kd, vd, cu_seqlens, out, lse, *aux = ctx.saved_tensors  # type: ignore[attr-defined]
        max_len, scale = ctx.max_len, ctx.scale  # type: ignore[attr-defined]
        T, nh, d = q.shape
        nkv = k0.shape[1]
        g = nh // nkv
        cdt = compute_dtype(q.dtype)
        grad_out = grad_out.to(q.dtype).contiguous()
        # the kernel's backward with the merged output/lse: the full softmax's gradient for
        # the step-0 keys and their share of dq (its delta = rowsum(dO·O) is the merged one)
        dq, dk0, dv0 = _kernel_backward(
            grad_out, q, k0, v0, out, lse, cu_seqlens, max_len, scale, tuple(aux)
        )
        # diagonal keys in closed form, float32
        qf = q.to(cdt).view(T, nkv, g, d)
        do = grad_out.to(cdt).view(T, nkv, g, -1)
        lse_t = lse.view(nkv, g, T).permute(2, 0, 1)
        delta = (do * out.to(cdt).view(T, nkv, g, -1)).sum(-1)  # [T, nkv, g]
        p = torch.exp(_diagonal_scores(qf, kd.to(cdt), scale) - lse_t)  # [m, T, nkv, g]
        dvd = torch.einsum("mtkg,tkgd->mtkd", p, do)
        ds = p * (torch.einsum("tkgd,mtkd->mtkg", do, vd.to(cdt)) - delta)
        dq = dq.to(cdt) + torch.einsum("mtkg,mtkd->tkgd", ds, kd.to(cdt)).reshape(T, nh, d) * scale
        dkd = torch.einsum("mtkg,tkgd->mtkd", ds, qf) * scale
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


def flash_ttt_attention(
    q: Tensor,
    k0: Tensor,
    v0: Tensor,
    kd: Tensor,
    vd: Tensor,
    cu_seqlens: Tensor,
    max_len: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Same contract as ``chunked_ttt_attention`` (q [nh, T, d], k0 [nkv, T, d], v0 [nkv, T,
    dv], kd/vd [m, nkv, T, ·]), documents given by ``cu_seqlens`` [n+1] and the longest
    document ``max_len`` (known on the host: passing it keeps the step free of host syncs).

    Inputs in the kernel's dtype (bf16/fp16 on CUDA; any float dtype on CPU)."""
    _, T, d = q.shape
    dv = v0.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if T else 0
    if dv < d:  # the kernel takes one head width (MLA's values are narrower): zero-pad
        v0, vd = F.pad(v0, (0, d - dv)), F.pad(vd, (0, d - dv))
    out = _FlashTTTAttention.apply(
        q.transpose(0, 1).contiguous(),
        k0.transpose(0, 1).contiguous(),
        v0.transpose(0, 1).contiguous(),
        kd.transpose(1, 2).contiguous(),
        vd.transpose(1, 2).contiguous(),
        cu_seqlens.to(torch.int32),
        max_len,
        scale,
    )
    return out[..., :dv].transpose(0, 1)


def flash_self_check(device: torch.device, seed: int = 0) -> list[str]:
    """The flash path on ``device`` against the chunked reference, on a small packed batch
    (documents of odd lengths, TTT 3, GQA): values and gradients in bf16 within 8·u·max|ref|
    (u = 2^-8; the tests' componentwise bound measured ≤ 0.6 of 3–4·u), and a negative
    control (one diagonal key moved) that must fail it. Returns the problems found."""
    g = torch.Generator().manual_seed(seed)
    lengths, m, nh, nkv, d = [37, 5, 64, 19, 3], 2, 4, 2, 64
    T = sum(lengths)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], device=device)
    doc_start = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=T)
    shapes = {
        "q": (nh, T, d),
        "k0": (nkv, T, d),
        "v0": (nkv, T, d),
        "kd": (m, nkv, T, d),
        "vd": (m, nkv, T, d),
    }
    inputs = {n: torch.randn(s, generator=g).to(device, torch.bfloat16) for n, s in shapes.items()}
    grad_out = torch.randn(nh, T, d, generator=g).to(device, torch.bfloat16)

    def run(fn, dtype, kd_moved: bool = False) -> dict[str, Tensor]:
        leaves = {n: x.to(dtype).requires_grad_() for n, x in inputs.items()}
        kd = leaves["kd"]
        if kd_moved:
            kd = torch.cat([kd[:, :, :1], kd[:, :, 2:3], kd[:, :, 1:2], kd[:, :, 3:]], dim=2)
        out = fn(leaves["q"], leaves["k0"], leaves["v0"], kd, leaves["vd"])
        out.backward(grad_out.to(dtype))
        return {"out": out.detach().float(), **{n: x.grad.float() for n, x in leaves.items()}}

    def reference(q, k0, v0, kd, vd):
        return chunked_ttt_attention(q, k0, v0, kd, vd, doc_start, chunk=32)

    def flash(q, k0, v0, kd, vd):
        return flash_ttt_attention(q, k0, v0, kd, vd, cu, max(lengths))

    ref = run(reference, torch.float32)
    bound = {n: 8 * 2.0**-8 * float(x.abs().max()) + 1e-6 for n, x in ref.items()}
    problems = []
    got = run(flash, torch.bfloat16)
    for name, x in ref.items():
        err = float((got[name] - x).abs().max())
        if not err <= bound[name]:
            problems.append(f"{name}: max error {err:.3g} > bound {bound[name]:.3g}")
    control = run(flash, torch.bfloat16, kd_moved=True)
    if all(float((control[n] - ref[n]).abs().max()) <= bound[n] for n in ("out", "q", "vd")):
        problems.append("negative control (one diagonal key moved) passed: the check is blind")
    return problems
