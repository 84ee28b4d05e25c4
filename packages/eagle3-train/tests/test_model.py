"""The draft's building blocks against independent references: TTT attention (chunked and
SDPA paths vs a float64 dense softmax), the fused LM-head KL vs plain autograd, and the
parameter names vs the checkpoint schema."""

from __future__ import annotations

import pytest
import torch

from eagle3_schemas.registry import load_schema
from eagle3_train.attention import (
    chunked_ttt_attention,
    dense_ttt_attention,
    flash_ttt_attention,
    ttt_mask,
)
from eagle3_train.loss import document_bounds, fused_linear_kl, reference_linear_kl
from eagle3_train.model import DraftArch, Eagle3Draft


def _arch(**kw) -> DraftArch:
    base = dict(
        hidden_size=16,
        num_aux=3,
        target_vocab_size=40,
        draft_vocab_size=20,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        rms_norm_eps=1e-6,
        target_rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    base.update(kw)
    return DraftArch(**base)


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
    loss, preds = fused_linear_kl(h, w, target, rows, chunk=7)
    (2.5 * loss).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref, ref_preds = reference_linear_kl(h, w, target, rows)
    (2.5 * ref).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(preds, ref_preds)
    torch.testing.assert_close(gh, h.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, w.grad, rtol=1e-5, atol=1e-7)


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


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    model = Eagle3Draft(_arch(**kw))
    g = torch.Generator().manual_seed(seed + 1)
    model.load_target_head(
        torch.randn(40, 16, generator=g),
        1 + 0.1 * torch.randn(16, generator=g),
        torch.randn(20, 16, generator=g),
    )
    return model


def test_sdpa_and_chunked_paths_give_the_same_loss_and_gradients():
    batch = _batch()
    results = []
    for impl in ("chunked", "sdpa"):
        model = _model(attention=impl, attention_chunk=16)
        loss, stats = model(*batch, ttt_steps=3)
        loss.backward()
        results.append((loss, stats, {n: p.grad for n, p in model.named_parameters()}))
    (l1, s1, g1), (l2, s2, g2) = results
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-6)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], rtol=1e-4, atol=1e-6)


def test_shapes_and_parameter_names_are_the_checkpoint_schema():
    model = _model(num_layers=2, norm_before_fc=True)
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
    assert loss.shape == () and stats.shape == (2, 5)


def test_lm_head_frozen_by_default_gets_no_gradient_but_rest_does():
    model = _model()
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
    model = _model(seed=4)
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
