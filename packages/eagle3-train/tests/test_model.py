"""The draft's building blocks against independent references: TTT attention (chunked and
SDPA paths vs a float64 dense softmax), the fused LM-head KL vs plain autograd, and the
parameter names vs the checkpoint schema."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eagle3_schemas.contract.registry import load_schema
from eagle3_train.model.attention import chunked_ttt_attention, dense_ttt_attention, ttt_mask
from eagle3_train.model.flash_attention import flash_ttt_attention
from eagle3_train.model.loss import NUM_STATS, fused_linear_kl
from eagle3_train.model.shift import document_bounds

from support.reference_kl import reference_linear_kl
from support.train import small_arch, small_draft


def _reference_attention(q, k0, v0, kd, vd, doc_start):
    """softmax(q·[k0 | kd]ᵀ/√d + mask)·[v0 | vd] in float64, keys repeated for GQA."""
    nh, _, d = q.shape
    g = nh // k0.shape[0]
    keys = torch.cat([k0.unsqueeze(0), kd]).permute(1, 0, 2, 3).reshape(k0.shape[0], -1, d)
    vals = torch.cat([v0.unsqueeze(0), vd]).permute(1, 0, 2, 3).reshape(k0.shape[0], -1, d)
    keys, vals = keys.repeat_interleave(g, 0), vals.repeat_interleave(g, 0)
    scores = q @ keys.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(~ttt_mask(doc_start, kd.shape[0]), float("-inf"))
    return torch.softmax(scores, -1) @ vals


@pytest.mark.parametrize("m", [0, 1, 3])
@pytest.mark.parametrize("chunk", [4, 64])
def test_ttt_attention_matches_dense_float64_reference(m, chunk):
    g = torch.Generator().manual_seed(m * 10 + chunk)
    lengths = [5, 9, 3, 12]
    T = sum(lengths)
    cu = torch.tensor([0, 5, 14, 17, 29])
    doc_start, _ = document_bounds(cu, T)
    shapes = {
        "q": (4, T, 8),
        "k0": (2, T, 8),
        "v0": (2, T, 8),
        "kd": (m, 2, T, 8),
        "vd": (m, 2, T, 8),
    }
    leaves = {
        n: torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
        for n, s in shapes.items()
    }
    grad_out = torch.randn(4, T, 8, generator=g, dtype=torch.float64)

    def grads(fn):
        for leaf in leaves.values():
            leaf.grad = None
        out = fn(*leaves.values(), doc_start)
        out.backward(grad_out)
        return out.detach(), {n: leaf.grad.clone() for n, leaf in leaves.items()}

    ref_out, ref_grads = grads(_reference_attention)
    flash = lambda q, k0, v0, kd, vd, _: flash_ttt_attention(q, k0, v0, kd, vd, cu)  # noqa: E731
    for fn in (lambda *a: chunked_ttt_attention(*a, chunk=chunk), dense_ttt_attention, flash):
        out, got = grads(fn)
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
        for name in leaves:
            torch.testing.assert_close(got[name], ref_grads[name], rtol=1e-9, atol=1e-10)


def test_fused_linear_kl_matches_autograd():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 16, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.log_softmax(torch.randn(37, 20, generator=g, dtype=torch.float64), -1)
    rows = (torch.rand(37, generator=g) < 0.7).double() / 30
    loss, kl, preds = fused_linear_kl(h, w, target, rows, chunk=7)
    (2.5 * loss).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref, ref_kl, ref_preds = reference_linear_kl(h, w, target, rows)
    torch.testing.assert_close(ref_kl, ref.detach(), rtol=0, atol=0)
    (2.5 * ref).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(kl, loss.detach(), rtol=0, atol=0)  # no top-k term: the KL
    assert torch.equal(preds, ref_preds)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("held_chunks", "gemms"), [(None, 1), (2, 3)], ids=["all", "by-two"])
def test_the_head_weight_gradient_is_one_gemm_per_held_rows(monkeypatch, held_chunks, gemms):
    """The LM head's gradient [V, H] is written by one GEMM over all chunks' rows (or one per
    HEAD_GRAD_ROWS_ELEMENTS of held d/dz), not one per chunk: each would read and write the
    float32 [V, H] gradient again. The gradient is the same (float64: to rounding)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from eagle3_train.model import loss as loss_module

    V, H, T, chunk = 20, 16, 37, 7  # 6 chunks
    if held_chunks is not None:
        monkeypatch.setattr(loss_module, "HEAD_GRAD_ROWS_ELEMENTS", held_chunks * chunk * V)

    class HeadGemms(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            gemm = func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
            if gemm and tuple(out.shape) == (V, H):
                HeadGemms.count += 1
            return out

    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.log_softmax(torch.randn(T, V, generator=g, dtype=torch.float64), -1)
    rows = torch.rand(T, generator=g, dtype=torch.float64) / 30
    with HeadGemms():
        loss, _, _ = fused_linear_kl(h, w, target, rows, chunk=chunk)
    assert HeadGemms.count == gemms
    loss.backward()
    got = w.grad.clone()
    w.grad = None
    reference_linear_kl(h, w, target, rows)[0].backward()
    torch.testing.assert_close(got, w.grad, rtol=1e-10, atol=1e-12)
    # no row scored: a zero gradient, no GEMM
    none = torch.empty(0, dtype=torch.long)
    loss, _, _ = fused_linear_kl(h, w, target, rows[:0], chunk=chunk, rows=none)
    w.grad = None
    loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def _batch(seed=0, lengths=(30, 18, 25)):
    g = torch.Generator().manual_seed(seed)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    mask = torch.rand(T, generator=g) < 0.7
    return (
        torch.randn(T, 3, 16, generator=g),
        torch.randn(T, 16, generator=g),
        torch.randint(0, 40, (T,), generator=g),
        mask,
        cu,
    )


def test_shapes_and_parameter_names_are_the_checkpoint_schema():
    model = small_draft(num_layers=2, norm_before_fc=True)
    schema = load_schema("draft_checkpoint")["files"]["weights"]["tensors"]
    state = model.state_dict()
    required = {n for n, spec in schema.items() if spec["required"]} - {"d2t", "t2d"}
    assert required <= set(state), f"schema tensors the model lacks: {required - set(state)}"
    assert state["fc.weight"].shape == (16, 3 * 16)
    assert state["layers.0.self_attn.q_proj.weight"].shape == (4 * 8, 2 * 16)
    assert state["layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 2 * 16)
    assert state["layers.1.self_attn.q_proj.weight"].shape == (4 * 8, 16)  # later layers: H
    assert "layers.1.hidden_norm.weight" not in state
    assert state["input_norm.weight"].shape == (3 * 16,)
    assert state["lm_head.weight"].shape == (20, 16)
    # frozen target pieces are buffers outside the state: never trained, never checkpointed
    assert not {"embed_tokens", "verifier_norm", "verifier_lm_head"} & set(state)
    loss, stats = model(*_batch(), ttt_steps=2)
    assert loss.shape == () and stats.shape == (2, NUM_STATS)


def test_lm_head_frozen_by_default_gets_no_gradient_but_rest_does():
    model = small_draft()
    model.lm_head.weight.requires_grad_(False)
    loss, _ = model(*_batch(), ttt_steps=2)
    loss.backward()
    assert model.lm_head.weight.grad is None
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() for p in model.trainable_parameters()
    )


def test_bf16_autocast_keeps_softmax_statistics_in_float32():
    """Under bf16 autocast (the GPU setting) the linear layers run in bf16 but attention,
    target distribution and KL stay float32: loss and gradients stay near the fp32 ones."""
    batch = _batch(seed=3)
    model = small_draft(seed=4)
    loss32, _ = model(*batch, ttt_steps=3)
    loss32.backward()
    grads32 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss16, _ = model(*batch, ttt_steps=3)
    loss16.backward()
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, loss32, rtol=3e-2, atol=1e-2)
    for name, g in grads32.items():
        cos = torch.nn.functional.cosine_similarity(
            g.flatten(), model.get_parameter(name).grad.flatten(), dim=0
        )
        assert cos > 0.98, (name, float(cos))


def _gamma(k: int, u: float) -> float:
    """Higham's gamma_k: the relative error bound of k float operations of unit round-off u."""
    return k * u / (1 - k * u)


def _cascade(k: int) -> int:
    """Roundings along one torch reduction of k terms (a cascade sum), with a few to spare."""
    return math.ceil(math.log2(k)) + 4


def test_fused_linear_kl_with_bf16_gemms_is_within_float32_round_off_of_float64():
    """The fused LM-head KL with bf16 GEMM inputs (the autocast path) against a float64
    reference on the same bf16 values. Products of bf16 numbers are exact in float32, so the
    only errors are float32 sums and the softmax in float32, bounded to first order by:
    each logit z_tv within gamma_H·(|h_t|·|W_v|) (a dot product of H exact products), which
    moves KL_t by at most sum_v |q - p|_tv of that; the log-softmax and KL reductions (torch's
    cascade sums: log2 of the length, plus a few) on their terms' magnitudes; then the sum over
    rows. The gradients add one rounding of d/dz = w·(q - p) to bf16, the GEMM's input. A
    float32 result rounded to bf16 anywhere in the forward exceeds the bound several times."""
    u32, u16 = 2.0**-24, 2.0**-8
    n, hidden, vocab = 97, 16, 301
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(n, hidden, generator=g) * 2).bfloat16().float().requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.25).bfloat16().float().requires_grad_(True)
    target = torch.log_softmax(2 * torch.randn(n, vocab, generator=g), -1)
    rows = (torch.rand(n, generator=g) < 0.7).float() / 30
    loss, _, _ = fused_linear_kl(h, w, target, rows, chunk=32, mm_dtype=torch.bfloat16)
    loss.backward()
    h64, w64 = (x.detach().double().requires_grad_(True) for x in (h, w))
    ref, _, _ = reference_linear_kl(h64, w64, target.double(), rows.double())
    ref.backward()

    hd, wd, logp, r = h64.detach(), w64.detach(), target.double(), rows.double()[:, None]
    z = hd @ wd.T
    scale = hd.abs() @ wd.abs().T  # each logit's float32 dot product error is gamma_H of it
    logq = torch.log_softmax(z, -1)
    p, q = logp.exp(), logq.exp()
    lse = torch.logsumexp(z, -1, keepdim=True)
    kl_bound = _gamma(hidden, u32) * ((q - p).abs() * scale).sum(-1) + _gamma(
        _cascade(vocab), u32
    ) * (p * (logp.abs() + logq.abs() + z.abs() + lse.abs())).sum(-1)
    kl = (p * (logp - logq)).sum(-1)
    loss_bound = (r[:, 0] * kl_bound).sum() + _gamma(_cascade(n), u32) * (r[:, 0] * kl).sum()
    got, want = float(loss.detach()), float(ref.detach())
    assert abs(got - want) <= float(loss_bound), (got, want, float(loss_bound))
    logit_error = _gamma(hidden, u32) * scale.amax(-1, keepdim=True)  # moves log q twice
    dz = r * (u16 + 2 * logit_error + _gamma(_cascade(vocab) + 4, u32)) * (q + p)
    grad_h_bound = dz @ wd.abs() + _gamma(vocab, u32) * ((r * (q + p)) @ wd.abs())
    grad_w_bound = dz.T @ hd.abs() + _gamma(n, u32) * ((r * (q + p)).T @ hd.abs())
    assert ((h.grad.double() - h64.grad).abs() <= grad_h_bound).all()
    assert ((w.grad.double() - w64.grad).abs() <= grad_w_bound).all()


def test_the_step_head_in_bf16_normed_and_gathered_per_chunk_is_within_bf16_round_off():
    """The LM head as the step calls it — the pre-norm state of all T slots, the final
    RMSNorm and the loss rows' gathers inside the chunk loop, targets at rows + offset, bf16
    GEMM inputs — against float64 autograd through the same norm, gathers and KL on the same
    bf16 values. Bound, first order in the unit round-offs (u = 2^-8 for bf16, 2^-24 for
    float32), gamma_k = k·u/(1 - k·u):

    - each normed row h_t is rounded to bf16 for the GEMM (u_h: u after a float32 norm,
      gamma of log2 H + a few), which moves KL_t by at most u_h·sum_i |h_ti|·|d KL_t/dh_ti|
      to first order; the float32 dot products move each logit by gamma_H(u32)·(|h_t|·|W_v|),
      KL_t by sum_v |q - p|_tv of that; with e_tv the two together, the second-order rest is
      at most sum_v q_tv·e_tv²/2 (the log-sum-exp's curvature);
    - the float32 log-softmax/KL reductions and the sum over rows, as in the test above;
    - d/dz = w·(q - p) is rounded to bf16 (u) and q moves with the logits (2·max_v e_tv);
      the GEMMs for d/dh and d/dW add gamma of their lengths (and d/dW h's rounding, u);
    - the norm's backward maps d/dh to d/dx by rstd·(dy - y·mean(dy·y)), dy = d/dh·w_norm
      (the error passes through that map in absolute values) and to d/dw_norm = sum_t d/dh·y.
    Rows outside the loss rows get exactly zero gradient."""
    u16, u32 = BF16_U, 2.0**-24
    T, hidden, vocab, offset, eps = 160, 32, 301, 2, 1e-6
    g = torch.Generator().manual_seed(5)
    bf = lambda x: x.bfloat16().float()  # noqa: E731  (bf16 values, held in float32)
    x = bf(torch.randn(T, hidden, generator=g) * 3).requires_grad_(True)
    nw = bf(1 + 0.3 * torch.randn(hidden, generator=g)).requires_grad_(True)
    w = bf(torch.randn(vocab, hidden, generator=g) * 0.25).requires_grad_(True)
    target = torch.log_softmax(2 * torch.randn(T, vocab, generator=g), -1)
    # rows whose target row (+ offset) and the next exist: a wrong offset stays in bounds
    rows = torch.nonzero(torch.rand(T - offset - 1, generator=g) < 0.6).flatten()
    row_w = (torch.rand(len(rows), generator=g) < 0.8).float() / 40
    loss, _, _ = fused_linear_kl(
        x, w, target, row_w, chunk=32, mm_dtype=torch.bfloat16, rows=rows,
        target_offset=offset, norm=(nw, eps),
    )  # fmt: skip
    loss.backward()

    x64, nw64, w64 = (t.detach().double().requires_grad_(True) for t in (x, nw, w))
    xr = x64[rows]
    rstd = torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + eps)
    h64 = nw64 * (xr * rstd)
    logp, r = target.double()[rows + offset], row_w.double()
    logq64 = torch.log_softmax(h64 @ w64.T, -1)
    ref = (r * (logp.exp() * (logp - logq64)).sum(-1)).sum()
    ref.backward()

    hd, wd, y, rstd = h64.detach(), w64.detach(), (xr * rstd).detach(), rstd.detach()
    z = hd @ wd.T
    logq, lse = torch.log_softmax(z, -1), torch.logsumexp(z, -1, keepdim=True)
    p, q = logp.exp(), logq.exp()
    u_h = u16 + _gamma(_cascade(hidden) + 4, u32)  # h: a float32 norm, then rounded to bf16
    # each logit's error: h's rounding (u_h) and the float32 dot product (gamma_H)
    e = (u_h + _gamma(hidden, u32)) * (hd.abs() @ wd.abs().T)
    e_max = e.amax(-1)
    kl = (p * (logp - logq)).sum(-1)
    gh = (r[:, None] * (q - p)) @ wd  # d/dh in float64 (r: the row weights)
    # to first order KL_t moves by (q - p)·dz: h's rounding enters through d/dh (whose sum
    # over V cancels), the dot product's through |q - p|; the rest is at most
    # lse's curvature, half of sum_v q·dz²
    kl_bound = (
        u_h * (hd.abs() * ((q - p) @ wd).abs()).sum(-1)
        + _gamma(hidden, u32) * ((q - p).abs() * (hd.abs() @ wd.abs().T)).sum(-1)
        + 0.5 * (q * e**2).sum(-1)
        + _gamma(_cascade(vocab), u32)
        * (p * (logp.abs() + logq.abs() + z.abs() + lse.abs())).sum(-1)
    )
    loss_bound = (r * kl_bound).sum() + _gamma(_cascade(len(rows)), u32) * (r * kl).sum()
    got, want = float(loss.detach()), float(ref.detach())
    assert abs(got - want) <= float(loss_bound), (
        f"loss {got} vs float64 {want}: error {abs(got - want):.3g} > bound {float(loss_bound):.3g}"
    )

    rq = r[:, None] * (q + p)  # |d/dz| ≤ this
    dz = r[:, None] * (u16 + 2 * e_max[:, None] + _gamma(_cascade(vocab) + 4, u32)) * (q + p)
    gh_bound = dz @ wd.abs() + _gamma(vocab, u32) * (rq @ wd.abs())
    gw_bound = dz.T @ hd.abs() + (u_h + _gamma(len(rows), u32)) * (rq.T @ hd.abs())
    dy, dy_bound = gh * nw64.detach(), gh_bound * nw64.detach().abs()
    mag = rstd * (dy.abs() + y.abs() * (dy * y).abs().mean(-1, keepdim=True))
    gx_bound = rstd * (dy_bound + y.abs() * (dy_bound * y.abs()).mean(-1, keepdim=True))
    gx_bound = gx_bound + _gamma(_cascade(hidden) + 6, u32) * mag
    gnw_bound = (gh_bound * y.abs()).sum(0) + _gamma(_cascade(len(rows)) + 2, u32) * (
        (gh * y).abs().sum(0)
    )
    checks = {
        "d/dx (loss rows)": (x.grad.double()[rows], x64.grad[rows], gx_bound),
        "d/dW": (w.grad.double(), w64.grad, gw_bound),
        "d/dw_norm": (nw.grad.double(), nw64.grad, gnw_bound),
    }
    for name, (grad, ref_grad, bound) in checks.items():
        err = (grad - ref_grad).abs()
        assert bool((err <= bound).all()), (
            f"{name}: max error {err.max():.3g}, worst ratio to the bound "
            f"{(err / bound)[bound > 0].max():.3g}"
        )
    others = torch.ones(T, dtype=torch.bool)
    others[rows] = False
    assert not x.grad[others].any(), "rows outside the loss rows got a gradient"


MLA_SHAPE = dict(
    q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6
)
# bf16's unit round-off: the relative error of rounding one value to bf16 (8 significant bits)
BF16_U = 2.0**-8


def _dense_scales(q, k0, v0, kd, vd, doc_start, grad_out):
    """float64 reference (out, grads) and each one's componentwise error scale: the same
    sums with every term replaced by its absolute value (P >= 0), so that a result whose
    terms each carry at most c roundings of relative size u is within c·u·scale."""
    nh, T, d = q.shape
    nkv, g = k0.shape[0], nh // k0.shape[0]
    keys = torch.cat([k0.unsqueeze(0), kd]).permute(1, 0, 2, 3).reshape(nkv, -1, d)
    vals = torch.cat([v0.unsqueeze(0), vd]).permute(1, 0, 2, 3).reshape(nkv, -1, v0.shape[-1])
    keys, vals = keys.repeat_interleave(g, 0), vals.repeat_interleave(g, 0)
    scale = d**-0.5
    s = (q @ keys.transpose(-1, -2) * scale).masked_fill(
        ~ttt_mask(doc_start, kd.shape[0]), float("-inf")
    )
    p = torch.softmax(s, -1)
    out = p @ vals
    dp = grad_out @ vals.transpose(-1, -2)
    delta = (grad_out * out).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    ds_abs = p * (grad_out.abs() @ vals.abs().transpose(-1, -2) + delta.abs())
    dq, dq_abs = ds @ keys * scale, ds_abs @ keys.abs() * scale
    dk, dk_abs = ds.transpose(-1, -2) @ q * scale, ds_abs.transpose(-1, -2) @ q.abs() * scale
    dv, dv_abs = p.transpose(-1, -2) @ grad_out, p.transpose(-1, -2) @ grad_out.abs()

    def split(x):  # [nh, (1+m)·T, ·] -> summed over each kv head's group, [k0-like], [kd-like]
        x = x.view(nkv, g, 1 + kd.shape[0], T, -1).sum(1).permute(1, 0, 2, 3)
        return x[0], x[1:]

    (dk0, dkd), (dk0_abs, dkd_abs) = split(dk), split(dk_abs)
    (dv0, dvd), (dv0_abs, dvd_abs) = split(dv), split(dv_abs)
    values = {"out": out, "q": dq, "k0": dk0, "v0": dv0, "kd": dkd, "vd": dvd}
    scales = {
        "out": p @ vals.abs(),
        "q": dq_abs,
        "k0": dk0_abs,
        "v0": dv0_abs,
        "kd": dkd_abs,
        "vd": dvd_abs,
    }
    return values, scales


def _flash_bf16(leaves, cu, grad_out, kd=None):
    bf = {n: x.to(torch.bfloat16).requires_grad_() for n, x in leaves.items()}
    if kd is not None:
        bf["kd"] = kd.to(torch.bfloat16).requires_grad_()
    out = flash_ttt_attention(bf["q"], bf["k0"], bf["v0"], bf["kd"], bf["vd"], cu)
    out.backward(grad_out.to(torch.bfloat16))
    return {"out": out.double(), **{n: x.grad.double() for n, x in bf.items()}}


@pytest.mark.parametrize("dv", [16, 8])  # 8: MLA's values narrower than its keys (padded)
def test_flash_attention_in_bf16_is_within_bf16_round_off_and_a_moved_diagonal_key_fails(dv):
    """The flash path on bf16 inputs against the float64 reference of the same bf16 values:
    packed documents of odd lengths, a padding document, TTT 3 (two diagonal keys), GQA.

    Bound, per element: c·u·scale (``_dense_scales``). The output's terms carry three bf16
    roundings (P before its GEMM with V as FlashAttention does, the kernel's output, the
    merged output), the gradients' four (P or dS before their GEMM, the bf16 output in the
    kernel's delta, dO·V's inputs, the result)."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 9, 3, 12, 3]  # the last one: padding, scored nowhere but attended within
    T, m = sum(lengths), 2
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    doc_start, _ = document_bounds(cu, T)
    shapes = {
        "q": (4, T, 16),
        "k0": (2, T, 16),
        "v0": (2, T, dv),
        "kd": (m, 2, T, 16),
        "vd": (m, 2, T, dv),
    }
    leaves = {  # bf16 values, held in float64 for the reference
        n: torch.randn(s, generator=g).to(torch.bfloat16).double() for n, s in shapes.items()
    }
    grad_out = torch.randn(4, T, dv, generator=g).to(torch.bfloat16).double()
    values, scales = _dense_scales(*leaves.values(), doc_start, grad_out)
    bounds = {n: (3 if n == "out" else 4) * BF16_U * scales[n] + 1e-12 for n in values}

    got = _flash_bf16(leaves, cu, grad_out)
    for name, ref in values.items():
        err = (got[name] - ref).abs()
        assert bool((err <= bounds[name]).all()), (
            f"{name}: max error {err.max():.3g}, worst ratio to the bound "
            f"{(err / bounds[name]).max():.3g}"
        )

    # negative control: slot 7's TTT-step-1 key replaced by its neighbour's (one diagonal
    # key moved) must break the bound, in the output and in the gradients
    moved = leaves["kd"].clone()
    moved[0, :, 7] = leaves["kd"][0, :, 8]
    wrong = _flash_bf16(leaves, cu, grad_out, kd=moved)
    for name in ("out", "q", "vd"):
        assert bool(((wrong[name] - values[name]).abs() > bounds[name]).any()), name


@pytest.mark.parametrize(
    ("impl", "architecture"), [("sdpa", "llama"), ("flash", "llama"), ("flash", "mla")]
)
def test_each_attention_path_gives_the_chunked_loss_and_gradients(impl, architecture):
    """The whole draft on each path, float32 on CPU: sdpa's dense mask and the flash path's
    wiring (document boundaries, lengths, GQA, MLA's value padding) against the reference."""
    batch = _batch()
    extra = {"architecture": "mla", **MLA_SHAPE} if architecture == "mla" else {}
    results = []
    for path in ("chunked", impl):
        model = small_draft(attention=path, attention_chunk=16, **extra)
        loss, stats = model(*batch, ttt_steps=3)
        loss.backward()
        results.append((loss, stats, {n: p.grad for n, p in model.named_parameters()}))
    (l1, s1, g1), (l2, s2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6)


def test_the_preflight_flash_check_passes_here_and_stops_a_kernel_with_another_lse_layout(
    monkeypatch,
):
    """What preflight runs on a CUDA host before training with the flash path, run here on
    the CPU kernel; a kernel whose log-sum-exp comes back in another row order (what a torch
    with another layout would give) is caught."""
    from eagle3_train.model import flash_attention as attention
    from eagle3_train.preflight.device import check_attention_kernel

    cpu = torch.device("cpu")
    assert attention.flash_self_check(cpu) == []
    (flash,) = check_attention_kernel(small_arch(attention="flash"), cpu, "bf16")
    assert flash.level == "ok" and "FlashAttention-2" in flash.message, flash
    (auto,) = check_attention_kernel(small_arch(attention="auto"), cpu, "bf16")  # chunked here
    assert auto.level == "ok" and "the chunked reference (flash needs" in auto.message, auto
    real = attention._kernel_forward

    def reordered_lse(*args):
        out, lse = real(*args)
        return out, lse.flip(-1).contiguous()

    monkeypatch.setattr(attention, "_kernel_forward", reordered_lse)
    (finding,) = check_attention_kernel(small_arch(attention="flash"), cpu, "bf16")
    assert finding.level == "error" and "disagrees with the chunked reference" in finding.message
    assert "out: max error" in finding.message


@pytest.mark.slow
def test_compiled_layers_and_loss_give_the_eager_loss_and_gradients():
    """train.compile as it runs on CUDA (decoder layers compiled with the attention step
    opaque to them, the flash attention and the loss chunk body compiled on their own), here
    with inductor's CPU code: the same loss and gradients
    as eager, for the Llama and the MLA draft (with fc_norm, norm_output and the LK divergence),
    with the default objective's top-k term. That
    something was compiled is shown, not assumed: inductor received the layers' graphs (a
    counting backend around it) and the loss chunk's, and dynamo broke no graph but at the
    attention (a break or an eager fallback would make this eager against eager)."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    from eagle3_train.config.train_config import ObjectiveConfig
    from eagle3_train.model.draft import compile_target_distribution
    from eagle3_train.model.flash_attention import compile_flash_attention
    from eagle3_train.model.loss import compile_kl_chunk

    batch = _batch()
    try:
        # the MLA draft with EAGLE 3.1's norms and the LK divergence (its TV inside the chunk)
        mla_31 = {"architecture": "mla", **MLA_SHAPE, "fc_norm": True, "norm_output": True}
        for extra, divergence in (({}, "kl"), (mla_31, "lk")):
            objective = ObjectiveConfig(topk_weight=1.0, divergence=divergence)
            results = []
            for compiled in (False, True):
                model = small_draft(attention="flash", **extra)
                torch._dynamo.reset()
                counters.clear()
                layers = CompileCounterWithBackend("inductor")
                if compiled:
                    for layer in model.layers:
                        layer.compile(backend=layers)
                compile_kl_chunk(compiled)
                compile_flash_attention(compiled)
                compile_target_distribution(compiled)
                loss, _ = model(*batch, ttt_steps=3, objective=objective)
                loss.backward()
                results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
                graphs = counters["stats"]["unique_graphs"]
                if compiled:
                    assert layers.frame_count >= 1 and layers.op_count > 0, extra
                    assert graphs > layers.frame_count, f"no graph of the loss chunk: {extra}"
                    # the one break by design: the attention, opaque to the compiler
                    breaks = [r for r in counters["graph_break"] if "ttt_attend" not in r]
                    assert not breaks, breaks
                else:
                    assert graphs == 0, f"the eager run compiled {graphs} graphs"
            (l1, g1), (l2, g2) = results
            torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
            for name in g1:
                # float32 rounding is relative to a tensor's scale (fc's gradient reaches ~25
                # with fc_norm: its small entries carry the large ones' absolute error)
                scale = max(1.0, float(g1[name].abs().max()))
                torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6 * scale)
    finally:
        compile_kl_chunk(False)
        compile_flash_attention(False)
        compile_target_distribution(False)


@pytest.mark.parametrize("architecture", ["llama", "mla"])
def test_under_bf16_autocast_the_compiled_layers_take_weights_cast_once_per_step(architecture):
    """A compiled layer's graph takes its GEMM weights as bf16 inputs, cast once per step for
    every TTT call (draft.cast_once), not as float32 parameters that each call would cast again
    and return float32 gradients for. Dynamo's graphs, run as captured (a recording backend),
    give eager autocast's loss and gradients bit for bit: the same computation."""
    from torch._dynamo.utils import counters

    weights: list[tuple[str, torch.dtype]] = []

    def record(graph: torch.fx.GraphModule, _inputs):
        for node in graph.graph.nodes:
            value = node.meta.get("example_value")
            named = "_parameters_weight_" in node.name and "norm" not in node.name
            if node.op == "placeholder" and named:
                weights.append((node.name, value.dtype))
        return graph.forward

    extra = {"architecture": "mla", **MLA_SHAPE} if architecture == "mla" else {}
    results = []
    for compiled in (False, True):
        model = small_draft(num_layers=2, **extra)
        torch._dynamo.reset()
        counters.clear()
        if compiled:
            for layer in model.layers:
                layer.compile(backend=record)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, _ = model(*_batch(), ttt_steps=3)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    linear = {name for name, m in model.layers[0].named_modules() if isinstance(m, nn.Linear)}
    assert len({name for name, _ in weights}) == len(linear), weights  # every one of them
    assert {dtype for _, dtype in weights} == {torch.bfloat16}, weights
    (eager_loss, eager), (loss, grads) = results
    assert torch.equal(loss, eager_loss)
    for name, grad in eager.items():
        assert grad.dtype == torch.float32 and torch.equal(grads[name], grad), name


def test_under_bf16_autocast_every_ttt_step_reaches_the_flash_kernel_in_bf16(monkeypatch):
    """After step 0 the fed-back state comes through a float32 residual: without care q and k
    of steps 1.. are float32, and `auto` would quietly fall back to the float32 reference path
    for them. Every kernel call must see bf16."""
    from eagle3_train.model import flash_attention as attention

    seen = []
    real = attention._kernel_forward

    def spy(q, k, v, *rest):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, *rest)

    monkeypatch.setattr(attention, "_kernel_forward", spy)
    batch = _batch()
    model = small_draft(attention="flash", norm_before_residual=True)  # the config's default
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(*batch, ttt_steps=3)
    loss.backward()
    assert seen == [(torch.bfloat16,) * 3] * 3
    assert bool(torch.isfinite(loss))
