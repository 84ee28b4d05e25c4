"""The GPU path of training-time-test attention (the math: attention.py).

``flash_ttt_attention``: FlashAttention-2 varlen (the kernel torch ships,
``aten::_flash_attention_forward``) over the document-causal step-0 keys returns the
output and its log-sum-exp; the diagonal keys (one score per slot and step) are merged in
closed form. The backward calls the kernel's backward with the *merged* output and
log-sum-exp, which is exactly the full softmax's gradient for the step-0 keys, and forms
the diagonal keys' gradients in closed form. On CPU the same structure runs on torch's
CPU flash kernel with a document-causal mask (how the tests check it without a GPU).

The kernel's forward and backward are ``torch.library`` custom ops (``eagle3::flash_forward``,
``eagle3::flash_backward``) with fake implementations, so a compiled graph holds them as opaque
calls: under train.compile the whole attention (kernel calls, merge, the closed-form backward)
is one ``torch.compile``d function, and Inductor fuses the merge's elementwise passes instead of
launching each one eagerly.

``resolve_attention`` picks the path of ``draft.attention: auto``: flash on CUDA in bf16 or
fp16 (the kernel's dtypes) where the kernel exists, the chunked reference otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from eagle3_train.model.attention import autocast_off, chunked_ttt_attention, compute_dtype, mm_f32

FLASH_DTYPES = (torch.float16, torch.bfloat16)
# The compute capabilities torch's FlashAttention-2 runs on (its sdp_utils: sm_80 to sm_121):
# Ampere, Ada, Hopper (sm_90), Blackwell data-centre (sm_100, B200/GB200) and workstation
# (sm_120, RTX PRO 6000). Outside them (a T4's sm_75) the chunked reference runs.
FLASH_CAPABILITIES = ((8, 0), (12, 1))


def flash_kernel_available(device: torch.device) -> bool:
    """The kernel this path calls exists for ``device`` in the installed torch."""
    if device.type == "cuda":
        low, high = FLASH_CAPABILITIES
        return (
            hasattr(torch.ops.aten, "_flash_attention_forward")
            and hasattr(torch.ops.aten, "_flash_attention_backward")
            and low <= torch.cuda.get_device_capability(device) <= high
        )
    return device.type == "cpu" and hasattr(
        torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"
    )


def resolve_attention(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto`` → "flash" on CUDA for half-precision compute where the kernel exists and runs
    on the GPU's compute capability, else "chunked" (the exact reference; CPU). Explicit
    choices are returned as they are."""
    if impl != "auto":
        return impl
    if device.type == "cuda" and dtype in FLASH_DTYPES and flash_kernel_available(device):
        return "flash"
    return "chunked"


def attention_kernel_note(impl: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which attention the step runs on ``device`` and why, in words (preflight prints it)."""
    chosen = resolve_attention(impl, device, dtype)
    where = str(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        where += f" ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
    if chosen == "flash":
        return f"{where}: FlashAttention-2 varlen (torch {torch.__version__}) with the TTT merge"
    name = {"chunked": "the chunked reference", "sdpa": "SDPA over a dense mask"}[chosen]
    if impl != "auto":
        return f"{where}: {name} (draft.attention: {impl})"
    (lo_major, lo_minor), (hi_major, hi_minor) = FLASH_CAPABILITIES
    why = (
        f"flash needs bf16 or fp16 compute on a GPU of sm_{lo_major}{lo_minor} to "
        f"sm_{hi_major}{hi_minor} with torch's FlashAttention-2"
    )
    return f"{where}: {name} ({why})"


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
) -> tuple[Tensor, Tensor]:
    """Document-causal attention of q [T, nh, d] over k, v [T, nkv, d]:
    (out [T, nh, d], lse [nh, T] float32; float64 for float64 inputs on CPU)."""
    T, nh, _ = q.shape
    if q.device.type == "cuda":
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
        )
        return out, lse
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
    return out[0].transpose(0, 1).contiguous(), lse[0].to(compute_dtype(q.dtype)).contiguous()


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
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v for the attention whose output and log-sum-exp are ``out`` and
    ``lse`` — which may include keys the kernel does not see (the merge)."""
    if q.device.type == "cuda":
        # dropout is 0: the kernel reads no random state (torch's own varlen_attn passes these)
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_len, max_len,
            0.0, True, rng, unused, scale=scale,
        )  # fmt: skip
        return dq, dk, dv
    T, nh, _ = q.shape
    nkv = k.shape[1]
    group = nh // nkv
    bias = _doc_causal_bias(cu_seqlens, T, q.dtype)
    qb, kb, vb, gb, ob = (
        x.transpose(0, 1).repeat_interleave(r, dim=0).unsqueeze(0)
        for x, r in ((q, 1), (k, group), (v, group), (grad_out, 1), (out, 1))
    )
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        gb, qb, kb, vb, ob, lse[None],
        0.0, False, attn_mask=bias, scale=scale,
    )  # fmt: skip

    def heads_to_kv(x: Tensor) -> Tensor:  # [1, nh, T, ·] summed over each kv head's group
        return x[0].view(nkv, group, T, -1).sum(1).transpose(0, 1).contiguous()

    return dq[0].transpose(0, 1).contiguous(), heads_to_kv(dk), heads_to_kv(dv)


# The kernel as custom ops: opaque to Dynamo and Inductor (which neither decompose nor trace
# into them). Their fake implementations are the same functions: on fake tensors the kernels'
# own meta functions give the outputs' shapes, dtypes and strides, so the two cannot drift.
@torch.library.custom_op("eagle3::flash_forward", mutates_args=())
def flash_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_len: int, scale: float
) -> tuple[Tensor, Tensor]:
    return _kernel_forward(q, k, v, cu_seqlens, max_len, scale)


@torch.library.custom_op("eagle3::flash_backward", mutates_args=())
def flash_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_len: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return _kernel_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_len, scale)


flash_forward.register_fake(_kernel_forward)
flash_backward.register_fake(_kernel_backward)


def _diagonal_scores(q: Tensor, kd: Tensor, scale: float) -> Tensor:
    """[T·nkv, g, m] scores of each slot's queries against its own later-step keys, float32
    (float64 for float64 inputs): q [T, nh, d], kd [T, nkv, m, d] in the kernel's dtype, one
    batched GEMM with float32 accumulation and result (``mm_f32``), no float32 copies."""
    T, nkv, m, d = kd.shape
    return mm_f32(q.reshape(T * nkv, -1, d), kd.reshape(T * nkv, m, d).transpose(1, 2)) * scale


class _FlashTTTAttention(torch.autograd.Function):
    """q [T, nh, d]; k0, v0 [T, nkv, d]; kd, vd [T, nkv, m, d] (v widths padded to d).

    The merge works per (slot, kv head): a batch of T·nkv tiny GEMMs over the group's g
    queries and the slot's m diagonal keys, bf16 inputs with float32 results. Probabilities,
    log-sum-exps and dS are float32 ([T·nkv, g, m], m ≤ TTT steps: small); P and dS are
    rounded to the inputs' dtype before their GEMMs, as the kernel does for the step-0 keys."""

    @staticmethod
    @autocast_off
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
        T, nh, _ = q.shape
        nkv, m, dv = kd.shape[1], kd.shape[2], vd.shape[-1]
        B, g = T * nkv, nh // nkv
        out0, lse0 = torch.ops.eagle3.flash_forward(q, k0, v0, cu_seqlens, max_len, scale)
        # merge: softmax over [step-0 keys | diagonal keys] from lse0 and the diagonal scores
        s = _diagonal_scores(q, kd, scale)  # [B, g, m]
        lse0_b = lse0.view(nkv, g, T).permute(2, 0, 1).reshape(B, g, 1)
        lse = torch.logsumexp(torch.cat([lse0_b.to(s.dtype), s], dim=-1), dim=-1, keepdim=True)
        p = torch.exp(s - lse)
        # w0·O0 (reading O0 in its dtype) plus P·Vd accumulated onto it in float32
        out = mm_f32(
            p.to(vd.dtype),
            vd.reshape(B, m, dv),
            accumulate=torch.exp(lse0_b - lse) * out0.reshape(B, g, dv),
        )
        out = out.view(T, nh, dv).to(q.dtype)
        lse = lse.view(T, nkv, g).permute(1, 2, 0).reshape(nh, T).contiguous()
        ctx.save_for_backward(q, k0, v0, kd, vd, cu_seqlens, out, lse)
        ctx.max_len, ctx.scale = max_len, scale  # type: ignore[attr-defined]
        return out

    @staticmethod
    @autocast_off
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_out: Tensor) -> tuple:  # type: ignore[override]
        q, k0, v0, kd, vd, cu_seqlens, out, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        max_len, scale = ctx.max_len, ctx.scale  # type: ignore[attr-defined]
        T, nh, d = q.shape
        nkv, m = kd.shape[1], kd.shape[2]
        B, g = T * nkv, nh // nkv
        grad_out = grad_out.to(q.dtype).contiguous()
        # the kernel's backward with the merged output/lse: the full softmax's gradient for
        # the step-0 keys and their share of dq (its delta = rowsum(dO·O) is the merged one)
        dq, dk0, dv0 = torch.ops.eagle3.flash_backward(
            grad_out, q, k0, v0, out, lse, cu_seqlens, max_len, scale
        )
        # diagonal keys in closed form: GEMMs on the inputs' dtype with float32 results
        do = grad_out.view(B, g, -1)
        dv = do.shape[-1]
        # delta = rowsum(dO·O): the diagonal of dO·Oᵀ over the group's heads (a g × g GEMM
        # per slot and kv head reads both once; g² ≤ a few dozen outputs)
        delta = mm_f32(do, out.view(B, g, dv).transpose(1, 2)).diagonal(dim1=1, dim2=2)
        delta = delta.unsqueeze(-1)
        lse_b = lse.view(nkv, g, T).permute(2, 0, 1).reshape(B, g, 1)
        p = torch.exp(_diagonal_scores(q, kd, scale) - lse_b)  # [B, g, m]
        dvd = mm_f32(p.to(do.dtype).transpose(1, 2), do)  # [B, m, dv]
        dp = mm_f32(do, vd.reshape(B, m, dv).transpose(1, 2))  # [B, g, m]
        ds = (p * (dp - delta) * scale).to(q.dtype)  # d/d(q·k), rounded for its GEMMs
        dq = mm_f32(ds, kd.reshape(B, m, d)).add_(dq.reshape(B, g, d))
        dkd = mm_f32(ds.transpose(1, 2), q.reshape(B, g, d))  # [B, m, d]
        return (
            dq.view(T, nh, d).to(q.dtype),
            dk0.to(k0.dtype),
            dv0.to(v0.dtype),
            dkd.view(kd.shape).to(kd.dtype),
            dvd.view(vd.shape).to(vd.dtype),
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
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if T else 0
    if _attend_impl is not _attend:
        # only the token and document counts vary between batches: the heads and widths stay
        # static, which keeps the compiled graphs' shape arithmetic small
        for x, dim in ((q, 1), (k0, 1), (v0, 1), (kd, 2), (vd, 2), (cu_seqlens, 0)):
            torch._dynamo.maybe_mark_dynamic(x, dim)
    return _attend_impl(q, k0, v0, kd, vd, cu_seqlens, max_len, scale)


def _attend(
    q: Tensor,
    k0: Tensor,
    v0: Tensor,
    kd: Tensor,
    vd: Tensor,
    cu_seqlens: Tensor,
    max_len: int,
    scale: float,
) -> Tensor:
    """The layouts in and out of ``_FlashTTTAttention`` around it (what is compiled)."""
    d, dv = q.shape[-1], v0.shape[-1]
    if dv < d:  # the kernel takes one head width (MLA's values are narrower): zero-pad
        v0, vd = F.pad(v0, (0, d - dv)), F.pad(vd, (0, d - dv))
    out = _FlashTTTAttention.apply(
        q.transpose(0, 1).contiguous(),
        k0.transpose(0, 1).contiguous(),
        v0.transpose(0, 1).contiguous(),
        kd.permute(2, 1, 0, 3).contiguous(),  # [T, nkv, m, ·]: the merge's batch layout
        vd.permute(2, 1, 0, 3).contiguous(),
        cu_seqlens.to(torch.int32),
        max_len,
        scale,
    )
    return out[..., :dv].transpose(0, 1)


_attend_impl: Callable[..., Tensor] = _attend


def compile_flash_attention(enabled: bool) -> None:
    """train.compile: the flash path as one ``torch.compile``d function, forward and backward
    (the kernel's custom ops stay opaque calls inside it), or eager."""
    global _attend_impl
    _attend_impl = torch.compile(_attend) if enabled else _attend


def flash_self_check(
    device: torch.device, seed: int = 0, attention: Callable[..., Tensor] = flash_ttt_attention
) -> list[str]:
    """``attention`` (the flash path) on ``device`` against the chunked reference, on a small
    packed batch (documents of odd lengths, TTT 3, GQA): values and gradients in bf16 within
    8·u·max|ref| (u = 2^-8; the tests' componentwise bound measured ≤ 0.6 of 3–4·u), and a
    negative control (one diagonal key moved) that must fail it on values and on gradients.
    Returns the problems found ("out: …" for values, "grad q: …" for a gradient)."""
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
        # fresh leaves per run: ``x.to(dtype)`` of a tensor already in ``dtype`` is that
        # tensor, and a second backward would add its gradients to the first run's
        leaves = {n: x.detach().clone().to(dtype).requires_grad_() for n, x in inputs.items()}
        kd = leaves["kd"]
        if kd_moved:
            kd = torch.cat([kd[:, :, :1], kd[:, :, 2:3], kd[:, :, 1:2], kd[:, :, 3:]], dim=2)
        out = fn(leaves["q"], leaves["k0"], leaves["v0"], kd, leaves["vd"])
        out.backward(grad_out.to(dtype))
        return {"out": out.detach().float(), **{n: x.grad.float() for n, x in leaves.items()}}

    def reference(q, k0, v0, kd, vd):
        return chunked_ttt_attention(q, k0, v0, kd, vd, doc_start, chunk=32)

    def flash(q, k0, v0, kd, vd):
        return attention(q, k0, v0, kd, vd, cu, max(lengths))

    ref = run(reference, torch.float32)
    bound = {n: 8 * 2.0**-8 * float(x.abs().max()) + 1e-6 for n, x in ref.items()}

    def failing(got: dict[str, Tensor]) -> dict[str, str]:
        errors = {n: float((got[n] - x).abs().max()) for n, x in ref.items()}
        return {
            n if n == "out" else f"grad {n}": f"max error {e:.3g} > bound {bound[n]:.3g}"
            for n, e in errors.items()
            if not e <= bound[n]
        }

    problems = [f"{n}: {why}" for n, why in failing(run(flash, torch.bfloat16)).items()]
    control = failing(run(flash, torch.bfloat16, kd_moved=True))
    if "out" not in control:
        problems.append("negative control (one diagonal key moved) passed on values: blind")
    if not any(n.startswith("grad ") for n in control):
        problems.append("negative control (one diagonal key moved) passed on gradients: blind")
    return problems
