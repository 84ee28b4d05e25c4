"""train.objective: the HASS top-k term, token-alignable masking and input noise, each against
an independent statement of what it should compute."""

from __future__ import annotations

import pytest
import torch

from eagle3_train.config import ConfigError, ObjectiveConfig, load_config, parse_override
from eagle3_train.loss import (
    TargetTopK,
    align,
    fused_linear_kl,
    reference_linear_kl,
    unpack_stats,
)
from eagle3_train.model import DraftArch, Eagle3Draft


def _kl_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 16, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.log_softmax(2 * torch.randn(37, 20, generator=g, dtype=torch.float64), -1)
    rows = (torch.rand(37, generator=g) < 0.7).double() / 30
    return h, w, target, rows


def _loss_and_grads(fn, h, w, *args, **kw):
    h.grad = w.grad = None
    loss, preds = fn(h, w, *args, **kw)
    (2.5 * loss).backward()
    return loss.detach(), preds, h.grad.clone(), w.grad.clone()


def test_fused_top_k_term_matches_autograd_and_full_k_is_cross_entropy():
    h, w, target, rows = _kl_inputs()
    top = TargetTopK.of(target, 5, 0.7)
    fused = _loss_and_grads(fused_linear_kl, h, w, target, rows, chunk=7, top=top)
    ref = _loss_and_grads(reference_linear_kl, h, w, target, rows, topk=5, topk_weight=0.7)
    # the tolerances of test_model's plain-KL twin test
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(fused[1], ref[1])
    for got, want in zip(fused[2:], ref[2:], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # The term is not zero: it changes the loss and both gradients.
    plain = _loss_and_grads(fused_linear_kl, h, w, target, rows, chunk=7)
    assert fused[0] > plain[0] + 1e-3
    assert not torch.allclose(fused[2], plain[2]) and not torch.allclose(fused[3], plain[3])
    # With k = the whole vocabulary the term is the cross-entropy H(p, q) = KL + H(p), so the
    # loss is (1 + w)·KL + w·H(p), computed here without the top-k code.
    whole = _loss_and_grads(
        fused_linear_kl, h, w, target, rows, chunk=7, top=TargetTopK.of(target, 20, 0.7)
    )
    entropy = -(target.exp() * target).sum(-1)
    expected = 1.7 * plain[0] + 0.7 * (entropy * rows).sum()
    torch.testing.assert_close(whole[0], expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(whole[3], 1.7 * plain[3], rtol=1e-5, atol=1e-7)


def _draft(seed: int = 0) -> Eagle3Draft:
    # A draft vocabulary of 3: a random draft proposes the target's token often enough that
    # every TTT step has slots whose earlier steps all matched.
    arch = DraftArch(
        hidden_size=16,
        num_aux=3,
        target_vocab_size=40,
        draft_vocab_size=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        rms_norm_eps=1e-6,
        target_rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    model = Eagle3Draft(arch)
    g = torch.Generator().manual_seed(seed + 1)
    model.load_target_head(
        torch.randn(40, 16, generator=g),
        1 + 0.1 * torch.randn(16, generator=g),
        torch.randn(3, 16, generator=g),
    )
    return model.double()


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


def test_mask_after_miss_scores_exactly_the_slots_whose_earlier_steps_matched():
    model = _draft()
    batch = _batch(loss_mask_fraction=1.1)  # every token scored: valid == inside the document
    plain_loss, plain = model(*batch, 3)
    masked_loss, masked = model(*batch, 3, objective=ObjectiveConfig(mask_after_miss=True))
    plain_steps, masked_steps = unpack_stats(plain), unpack_stats(masked)
    # Step 0 is untouched; the predictions (and so the accuracy counts) do not depend on it.
    torch.testing.assert_close(masked_steps[0].loss, plain_steps[0].loss)
    for p, m in zip(plain_steps, masked_steps, strict=True):
        assert (m.scored, m.full_correct, m.cond_total) == (p.scored, p.full_correct, p.cond_total)
    for k in (1, 2):
        # cond_total counts the slots whose steps 0..k-1 matched (in the document): with every
        # token scored these are exactly the slots the masked loss averages over.
        assert int(masked_steps[k].loss_slots) == int(plain_steps[k].cond_total)
        assert 0 < int(masked_steps[k].loss_slots) < int(plain_steps[k].scored)
        assert int(plain_steps[k].loss_slots) == int(plain_steps[k].scored)
    # The masked step-k loss is the mean KL over those slots: recompute it from the model's
    # own pieces with a plain loop that keeps the chain by hand.
    aux, last, ids, mask, cu = batch
    al = align(ids, mask, cu, 3)
    with torch.no_grad():
        target_logp = model.target_log_probs(last)
        chain = al.valid[0].clone()
        expected = []
        for k in range(3):
            logits, preds = _draft_logits(model, aux, al, k)
            rows = torch.nonzero(al.valid[k] & (chain if k else al.valid[0])).flatten()
            p = target_logp[rows + 1 + k]
            kl = (p.exp() * (p - torch.log_softmax(logits[rows], -1))).sum(-1)
            expected.append(kl.mean())
            chain = chain & al.in_doc[k] & (preds == target_logp.argmax(-1).roll(-1 - k))
    for k in range(3):
        torch.testing.assert_close(masked_steps[k].loss, expected[k], rtol=1e-6, atol=1e-8)
    assert not torch.isclose(masked_loss, plain_loss)


def _draft_logits(model: Eagle3Draft, aux, al, k: int):
    """The draft's step-k logits for every slot (the model's forward, step by step)."""
    from eagle3_train.model import LayerCache

    x = model.input_norm(aux.reshape(aux.shape[0], -1)) if model.arch.norm_before_fc else None
    hidden = model.fc(x if x is not None else aux.reshape(aux.shape[0], -1))
    caches = [LayerCache() for _ in model.layers]
    for step in range(k + 1):
        embeds = torch.nn.functional.embedding(al.step_tokens[step], model.embed_tokens)
        cos, sin = model.rotary(al.positions + step, hidden.dtype)
        x = hidden
        for i, layer in enumerate(model.layers):
            x = layer(x, embeds if i == 0 else None, cos, sin, caches[i], al)
        normed = model.norm(x)
        hidden = normed if model.arch.norm_output else x
    logits = normed @ model.lm_head.weight.T
    return logits, logits.argmax(-1)


def test_input_noise_acts_in_training_only_and_is_seeded():
    model = _draft()
    batch = _batch(loss_mask_fraction=0.7)
    noisy = ObjectiveConfig(input_noise=0.2)
    model.eval()
    clean, _ = model(*batch, 3)
    evaluated, _ = model(*batch, 3, objective=noisy)
    assert torch.equal(clean, evaluated)  # validation never sees noise
    model.train()
    torch.manual_seed(7)
    first, _ = model(*batch, 3, objective=noisy)
    torch.manual_seed(7)
    again, _ = model(*batch, 3, objective=noisy)
    assert torch.equal(first, again)
    assert not torch.isclose(first, clean)
    tiny, _ = model(*batch, 3, objective=ObjectiveConfig(input_noise=1e-9))
    torch.testing.assert_close(tiny, clean, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.objective.topk=0", "train.objective.topk: 0 < 1"),
        ("train.objective.topk_weight=-1", "train.objective.topk_weight: -1.0 must be >= 0"),
        ("train.objective.input_noise=-0.1", "train.objective.input_noise: -0.1 must be >= 0"),
        ("train.objective.mask_after_misses=true", "mask_after_misses"),
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
        "train: {objective: {mask_after_miss: true, topk_weight: 0.5}}\n"
    )
    loaded = load_config(config, [parse_override("train.objective.topk=4")])
    assert loaded.train.objective == ObjectiveConfig(
        mask_after_miss=True, topk=4, topk_weight=0.5, input_noise=0.0
    )
