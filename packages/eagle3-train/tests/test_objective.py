"""train.objective: the HASS top-k term against an independent statement of what it should
compute, and its configuration."""

from __future__ import annotations

import pytest
import torch

from eagle3_train.config.run_config import ConfigError, load_config, parse_override
from eagle3_train.config.train_config import ObjectiveConfig
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.loss import TargetTopK, fused_linear_kl, unpack_stats

from support.reference_kl import reference_linear_kl
from support.train import small_draft


def _kl_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 16, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.log_softmax(2 * torch.randn(37, 20, generator=g, dtype=torch.float64), -1)
    rows = (torch.rand(37, generator=g) < 0.7).double() / 30
    return h, w, target, rows


def _loss_and_grads(fn, h, w, *args, **kw):
    h.grad = w.grad = None
    loss, kl, preds = fn(h, w, *args, **kw)
    (2.5 * loss).backward()
    return loss.detach(), kl, preds, h.grad.clone(), w.grad.clone()


def test_fused_top_k_term_matches_autograd_and_full_k_is_cross_entropy():
    h, w, target, rows = _kl_inputs()
    top = TargetTopK.of(target, 5, 0.7)
    fused = _loss_and_grads(fused_linear_kl, h, w, target, rows, chunk=7, top=top)
    ref = _loss_and_grads(reference_linear_kl, h, w, target, rows, topk=5, topk_weight=0.7)
    # the tolerances of test_model's plain-KL twin test
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-6, atol=1e-7)
    assert torch.equal(fused[2], ref[2])
    for got, want in zip(fused[3:], ref[3:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # The term is not zero: it changes the loss and both gradients, and the KL reported beside
    # the loss leaves it out.
    plain = _loss_and_grads(fused_linear_kl, h, w, target, rows, chunk=7)
    assert fused[0] > plain[0] + 1e-3
    torch.testing.assert_close(fused[1], plain[0], rtol=1e-6, atol=1e-7)
    assert not torch.allclose(fused[3], plain[3]) and not torch.allclose(fused[4], plain[4])
    # With k = the whole vocabulary the term is the cross-entropy H(p, q) = KL + H(p), so the
    # loss is (1 + w)·KL + w·H(p), computed here without the top-k code.
    whole = _loss_and_grads(
        fused_linear_kl, h, w, target, rows, chunk=7, top=TargetTopK.of(target, 20, 0.7)
    )
    entropy = -(target.exp() * target).sum(-1)
    expected = 1.7 * plain[0] + 0.7 * (entropy * rows).sum()
    torch.testing.assert_close(whole[0], expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(whole[4], 1.7 * plain[4], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("topk_weight", [0.0, 0.7], ids=["alone", "with_top_k"])
@pytest.mark.parametrize("divergence", ["tv", "lk"])
def test_fused_acceptance_losses_match_autograd(divergence: str, topk_weight: float):
    """TV and the LK hybrid inside the fused chunk (hand-made gradients) equal plain autograd
    on their definitions (TV as half the L1 distance), values and gradients."""
    h, w, target, rows = _kl_inputs(seed=3)
    top = TargetTopK.of(target, 5, topk_weight)
    kw = {"divergence": divergence, "lk_eta": 2.0}
    fused = _loss_and_grads(fused_linear_kl, h, w, target, rows, chunk=7, top=top, **kw)
    ref = _loss_and_grads(
        reference_linear_kl, h, w, target, rows, topk=5, topk_weight=topk_weight, **kw
    )
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(fused[1], ref[1], rtol=1e-9, atol=1e-12)  # the KL reported
    assert torch.equal(fused[2], ref[2])
    for got, want in zip(fused[3:], ref[3:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-12)
    # Negative controls: the gradients are not KL's, and (LK) not those of a λ that carries
    # a gradient of its own — the comparison sees either mistake.
    kl = _loss_and_grads(fused_linear_kl, h, w, target, rows, chunk=7, top=top)
    assert not torch.allclose(fused[3], kl[3], rtol=1e-3, atol=1e-6)
    if divergence == "lk":
        h.grad = None
        logq = torch.log_softmax(h @ w.T, -1)
        kl_t = (target.exp() * (target - logq)).sum(-1)
        tv_t = 0.5 * (target.exp() - logq.exp()).abs().sum(-1)
        lam = torch.exp(-2.0 * (1 - tv_t))  # not held constant
        top_ce = 0.0
        if topk_weight:
            top_logp, top_ids = target.topk(5, dim=-1)
            top_ce = -topk_weight * (top_logp.exp() * logq.gather(-1, top_ids)).sum(-1)
        (2.5 * ((lam * kl_t + (1 - lam) * tv_t + top_ce) * rows).sum()).backward()
        assert not torch.allclose(fused[3], h.grad, rtol=1e-3, atol=1e-6)


def test_one_minus_tv_is_the_acceptance_rate_of_speculative_sampling():
    """Per row, 1 - TV(p, q) = E_{x~q}[min(1, p_x / q_x)]: the chance that speculative
    sampling accepts a token drawn from the draft (Leviathan et al.), computed here from that
    definition."""
    h, w, target, _ = _kl_inputs(seed=5)
    for row in range(4):
        one = torch.zeros(1, dtype=torch.float64) + 1
        tv, _, _ = fused_linear_kl(h[row : row + 1], w, target[row : row + 1], one, divergence="tv")
        q = torch.softmax(h[row] @ w.T, -1)
        accept = (q * torch.clamp(target[row].exp() / q, max=1.0)).sum()
        torch.testing.assert_close(1 - tv, accept, rtol=1e-12, atol=1e-12)


def _draft(seed: int = 0) -> Eagle3Draft:
    return small_draft(seed, draft_vocab_size=3).double()


def _batch(loss_mask_fraction: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = (60, 45, 70)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    return (
        torch.randn(T, 3, 16, generator=g, dtype=torch.float64),
        torch.randn(T, 16, generator=g, dtype=torch.float64),
        torch.randint(0, 40, (T,), generator=g),
        torch.rand(T, generator=g) < loss_mask_fraction,
        cu,
    )


def test_the_default_objective_adds_the_top_k_term_and_reports_the_plain_kl():
    model = _draft()
    batch = _batch(loss_mask_fraction=0.7)
    plain_loss, plain = model(*batch, 3)  # no objective: plain EAGLE-3 TTT
    loss, stats = model(*batch, 3, objective=ObjectiveConfig())
    assert ObjectiveConfig().topk_weight == 1.0 and ObjectiveConfig().topk == 10
    assert loss > plain_loss + 1e-3
    for p, d in zip(unpack_stats(plain), unpack_stats(stats), strict=True):
        torch.testing.assert_close(d.kl_sum, p.kl_sum, rtol=1e-9, atol=1e-12)
        assert d.loss > p.loss
        assert (d.scored, d.full_correct, d.cond_total) == (p.scored, p.full_correct, p.cond_total)


@pytest.mark.parametrize("divergence", ["tv", "lk"])
def test_the_divergence_is_what_the_ttt_loss_sums_and_the_reported_kl_stays(divergence):
    model = _draft()
    batch = _batch(loss_mask_fraction=0.7)
    _, kl_stats = model(*batch, 3, objective=ObjectiveConfig(topk_weight=0.0))
    loss, stats = model(
        *batch, 3, objective=ObjectiveConfig(topk_weight=0.0, divergence=divergence)
    )
    steps, kl_steps = unpack_stats(stats), unpack_stats(kl_stats)
    torch.testing.assert_close(loss, sum(s.loss for s in steps).to(loss.dtype))
    for s, k in zip(steps, kl_steps, strict=True):
        torch.testing.assert_close(s.kl_sum, k.kl_sum, rtol=1e-9, atol=1e-12)
        assert not torch.isclose(s.loss, k.loss)
    if divergence == "tv":  # a mean of per-slot TVs: in [0, 1]
        assert all(0 < float(s.loss) < 1 for s in steps)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.objective.topk=0", "train.objective.topk: 0 < 1"),
        ("train.objective.topk_weight=-1", "train.objective.topk_weight: -1.0 must be >= 0"),
        ("train.objective.input_noise=0.1", "input_noise"),  # dropped options are unknown keys
        ("train.objective.divergence=jsd", "train.objective.divergence"),
        ("train.objective.lk_eta=-1", "train.objective.lk_eta: -1.0 must be >= 0"),
    ],
)
def test_objective_values_that_cannot_train_are_refused(tmp_path, override, message):
    config = tmp_path / "c.yaml"
    config.write_text("data: {hidden_states: h, vocab_map: v.safetensors}\n")
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(config, [parse_override(override)])


def test_objective_is_read_from_yaml_and_overrides(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(
        "data: {hidden_states: h, vocab_map: v.safetensors}\n"
        "train: {objective: {topk_weight: 0.5}}\n"
    )
    loaded = load_config(config, [parse_override("train.objective.topk=4")])
    assert loaded.train.objective == ObjectiveConfig(topk=4, topk_weight=0.5)
    assert load_config(config.with_name("c.yaml"), []).train.objective.topk == 10
