"""train.recompute (recompute.py): each decoder layer recomputed in backward per TTT step gives
the loss and gradients of the step that kept its activations."""

from __future__ import annotations

import pytest
import torch

from eagle3_train.config.train_config import ObjectiveConfig
from eagle3_train.model.draft import Eagle3Draft

from support.train import small_arch

MLA = dict(
    architecture="mla",
    q_lora_rank=12,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
)


def _model(**kw) -> Eagle3Draft:
    arch = small_arch(
        num_layers=2,  # a later layer reads the first's output: both recomputed
        attention_chunk=16,  # several query chunks per document
        **kw,
    )
    torch.manual_seed(0)
    model = Eagle3Draft(arch)
    g = torch.Generator().manual_seed(1)
    model.load_target_head(
        torch.randn(40, 16, generator=g),
        1 + 0.1 * torch.randn(16, generator=g),
        torch.randn(20, 16, generator=g),
    )
    return model


def _packed(lengths=(30, 18, 25)):
    g = torch.Generator().manual_seed(2)
    T = sum(lengths)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    return (
        torch.randn(T, 3, 16, generator=g),
        torch.randn(T, 16, generator=g),
        torch.randint(0, 40, (T,), generator=g),
        torch.rand(T, generator=g) < 0.7,
        cu,
    )


def _step(model: Eagle3Draft, recompute: bool, grad: bool = True) -> tuple[torch.Tensor, dict, int]:
    """Loss, gradients and how many times the decoder layers started a forward (a pre-hook:
    the recomputation stops once it has what backward needs, before the layer returns)."""
    runs = 0

    def count(*_):
        nonlocal runs
        runs += 1

    for layer in model.layers:
        layer.recompute = recompute
        layer.register_forward_pre_hook(count)
    with torch.set_grad_enabled(grad):
        loss, _ = model(*_packed(), ttt_steps=3, objective=ObjectiveConfig(topk_weight=1.0))
    if grad:
        loss.backward()
    return (
        loss.detach(),
        {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        runs,
    )


@pytest.mark.parametrize("attention", ["chunked", "sdpa"])
@pytest.mark.parametrize("shape", [{}, MLA], ids=["llama", "mla"])
def test_recomputed_layers_give_bit_equal_loss_and_gradients(shape, attention):
    """Bit-equal, not close: the recomputation runs the same float32 CPU kernels on the same
    tensors in the same order (the cache replayed as it stood before each step), and CPU
    kernels are deterministic, so anything but equality is a different computation. The
    layers ran forward twice as often (once more in backward): checkpointing was on."""
    eager_loss, eager, runs = _step(_model(attention=attention, **shape), recompute=False)
    loss, grads, recomputed_runs = _step(_model(attention=attention, **shape), recompute=True)
    assert recomputed_runs == 2 * runs == 2 * 2 * 3, (runs, recomputed_runs)
    assert torch.equal(loss, eager_loss), (float(loss), float(eager_loss))
    assert grads.keys() == eager.keys()
    for name, grad in eager.items():
        assert torch.equal(grads[name], grad), (
            f"{name}: max difference {float((grads[name] - grad).abs().max()):.3g}"
        )


def test_without_gradients_the_layers_run_once():
    """Validation (no_grad) does not checkpoint: one forward per layer and step."""
    _, _, runs = _step(_model(attention="chunked"), recompute=True, grad=False)
    assert runs == 2 * 3


@pytest.mark.slow
def test_recompute_under_compiled_layers_gives_the_compiled_loss_and_gradients():
    """train.recompute with train.compile (inductor's CPU code here): the checkpoint wraps the
    compiled layer, so backward reruns the compiled forward. Bit-equal to the compiled run
    without recompute, for both drafts; dynamo broke no graph but at the attention (by
    design), so the compiled code ran, not an eager fallback."""
    from torch._dynamo.utils import counters

    for shape in ({}, MLA):
        results = []
        for recompute in (False, True):
            model = _model(attention="chunked", **shape)
            torch._dynamo.reset()
            counters.clear()
            for layer in model.layers:
                layer.compile()
            results.append(_step(model, recompute))
            assert counters["stats"]["unique_graphs"] >= 1, shape
            breaks = [r for r in counters["graph_break"] if "ttt_attend" not in r]
            assert not breaks, breaks
        (eager_loss, eager, runs), (loss, grads, recomputed_runs) = results
        assert recomputed_runs == 2 * runs, (runs, recomputed_runs)
        assert torch.equal(loss, eager_loss), shape
        for name, grad in eager.items():
            assert torch.equal(grads[name], grad), name


def test_train_recompute_reaches_every_decoder_layer():
    """The trainer applies train.recompute with the other layer settings (build.speed_up)."""
    from types import SimpleNamespace

    from eagle3_train.components.build import speed_up
    from eagle3_train.config.run_config import Config

    for setting in (False, True):
        model, config = _model(), Config()
        config.train.recompute, config.train.compile = setting, "never"
        speed_up(model, config, SimpleNamespace(mixed_precision="no", device=torch.device("cpu")))
        assert [layer.recompute for layer in model.layers] == [setting, setting]
