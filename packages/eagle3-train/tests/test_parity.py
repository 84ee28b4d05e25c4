"""Parity with the field: speculators 0.9.0's Eagle3DraftModel on the same weights and batch.

speculators runs on CPU with sdpa attention and its eager kl_div loss (its defaults,
FlexAttention and a Triton-fused loss, need a GPU). Tolerance: 1e-5 relative on losses and
gradients (float32; the two differ only in summation order and RoPE's absolute offset).

Differences by design, stated and tested:
- speculators receives per-sample shifted data (``shift_batch``: drop x_0, aux[T-1],
  last[0], loss_mask[0]) and positions from 1; we receive the unshifted packed rows and
  apply the same shift inside (shift.align), with positions from 0 as vLLM does. RoPE sees
  only differences, so attention is the same.
- at TTT step k, speculators scores the last k slots of a packed document against the
  next document's first rows; we never score across documents. The parity batches keep
  loss_mask = 0 on each document's first and last ttt_steps+1 rows, where only that
  difference could show; ``test_cross_document_scoring_is_the_stated_difference`` shows it.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from eagle3_train.model.arch import DraftArch
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.loss import unpack_stats

H, N_AUX, V_T, V_D, HEADS, KV, HEAD_DIM, INTER = 16, 3, 40, 20, 4, 2, 8, 32
TTT = 3
RTOL = 1e-5
# The layer's shape, the same in speculators' LlamaConfig and our DraftArch.
SHAPE = {
    "hidden_size": H,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HEAD_DIM,
    "intermediate_size": INTER,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
}


# The draft's optional norms, each off unless a test turns it on.
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _spec_model(layers: int, **flags: bool):
    assert set(flags) <= set(NORM_FLAGS), f"not a norm flag: {set(flags) - set(NORM_FLAGS)}"
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    tl = LlamaConfig(**SHAPE, vocab_size=V_T, num_hidden_layers=layers)
    tl._attn_implementation = "sdpa"  # FlexAttention has no CPU backward
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=V_D,
        **{name: flags.get(name, False) for name in NORM_FLAGS},
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=TTT)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    return Eagle3DraftModel(cfg)


def build_pair(seed: int = 0, **flags):
    layers = flags.pop("layers", 1)
    torch.manual_seed(seed)
    theirs = _spec_model(layers=layers, **flags)
    g = torch.Generator().manual_seed(seed)
    chosen = torch.sort(torch.randperm(V_T, generator=g)[:V_D]).values
    t2d = torch.zeros(V_T, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(V_D)
    theirs.load_vocab_mappings(t2d, d2t)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        lm_rows = 0.3 * torch.randn(V_D, H, generator=g)
        theirs.lm_head.weight.copy_(lm_rows)
        theirs.verifier_lm_head.weight.copy_(0.5 * torch.randn(V_D, H, generator=g))
    arch = DraftArch(
        **SHAPE,
        num_aux=N_AUX,
        target_vocab_size=V_T,
        draft_vocab_size=V_D,
        target_rms_norm_eps=1e-6,
        num_layers=layers,
        **flags,
    )
    ours = Eagle3Draft(arch)
    state = theirs.state_dict()
    ours.load_target_head(
        state["embed_tokens.weight"],
        state["verifier_norm.weight"],
        state["verifier_lm_head.weight"],
        init_lm_head=False,
    )
    mine = {k: v for k, v in state.items() if k in dict(ours.named_parameters())}
    missing = set(dict(ours.named_parameters())) - set(mine)
    assert not missing, f"names not shared with speculators: {missing}"
    ours.load_state_dict(mine, strict=False)
    ours.lm_head.weight.requires_grad_(False)  # speculators keeps lm_head frozen
    return ours, theirs


def make_batch(lengths: list[int], seed: int = 1, guard: int = TTT + 1):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    aux = torch.randn(total, N_AUX, H, generator=g)
    last = torch.randn(total, H, generator=g)
    ids = torch.randint(0, V_T, (total,), generator=g)
    mask = torch.zeros(total, dtype=torch.bool)
    start = 0
    for n in lengths:
        inner = torch.rand(n, generator=g) < 0.8
        inner[:guard] = False
        inner[n - guard :] = False
        mask[start : start + n] = inner
        start += n
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    return aux, last, ids, mask, cu


def speculators_inputs(aux, last, ids, mask, cu):
    """speculators' own per-sample shift_batch, then packing (its data pipeline's order)."""
    from speculators.models.eagle3.data import shift_batch

    parts = []
    for i in range(len(cu) - 1):
        s, e = int(cu[i]), int(cu[i + 1])
        n = e - s
        parts.append(
            shift_batch(
                {
                    "input_ids": ids[s:e],
                    "hidden_states": aux[s:e].reshape(n, -1),
                    "verifier_last_hidden_states": last[s:e],
                    "loss_mask": mask[s:e],
                    "lengths": torch.tensor([n]),
                    "position_ids": torch.arange(n),
                }
            )
        )
    cat = {
        k: torch.cat([p[k] for p in parts])
        for k in (
            "input_ids",
            "hidden_states",
            "verifier_last_hidden_states",
            "loss_mask",
            "position_ids",
        )
    }
    doc = torch.cat([torch.full((len(p["input_ids"]),), i) for i, p in enumerate(parts)])
    return dict(
        hidden_states=cat["hidden_states"][None],
        input_ids=cat["input_ids"][None],
        document_ids=doc[None],
        loss_mask=cat["loss_mask"][None],
        position_ids=cat["position_ids"][None],
        verifier_last_hidden_states=cat["verifier_last_hidden_states"][None],
    )


def run_theirs(theirs, batch, decay=1.0, loss_fn="kl_div"):
    from speculators.losses.utils import resolve_loss_config

    with warnings.catch_warnings():
        # transformers warns that sdpa ignores output_attentions; not ours to fix
        warnings.simplefilter("ignore", UserWarning)
        _, loss, metrics = theirs(
            **speculators_inputs(*batch),
            ttt_steps=TTT,
            ttt_step_loss_decay=decay,
            loss_config=resolve_loss_config(loss_fn, "eager"),
        )
    return loss, metrics


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"norm_before_residual": True},
        {"norm_before_fc": True, "norm_output": True},
        {"fc_norm": True, "norm_output": True},
        {"layers": 2},
    ],
    ids=[
        "plain",
        "norm_before_residual",
        "norm_before_fc+norm_output",
        "fc_norm+norm_output",
        "two_layers",
    ],
)
def test_loss_metrics_and_grads_match_speculators(flags):
    ours, theirs = build_pair(**flags)
    batch = make_batch([23, 17, 30])
    their_loss, metrics = run_theirs(theirs, batch)
    loss, stats = ours(*batch, ttt_steps=TTT)
    torch.testing.assert_close(loss, their_loss.float(), rtol=RTOL, atol=1e-6)
    for k, step in enumerate(unpack_stats(stats)):
        torch.testing.assert_close(
            step.loss.float(), metrics[f"loss_{k}_sum"], rtol=RTOL, atol=1e-6
        )
        assert float(step.scored) == float(metrics[f"full_acc_{k}_total"])
        assert float(step.full_correct) == float(metrics[f"full_acc_{k}_sum"])
        assert float(step.cond_total) == float(metrics[f"cond_acc_{k}_total"])
    their_loss.backward()
    loss.backward()
    theirs_params = dict(theirs.named_parameters())
    compared = 0
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, theirs_params[name].grad, rtol=1e-4, atol=1e-6)
            compared += 1
    assert compared >= 10


@pytest.mark.parametrize(("ours_name", "their_name"), [("tv", "tv"), ("lk", "lk_hybrid")])
def test_acceptance_losses_match_speculators(ours_name: str, their_name: str):
    """train.objective.divergence tv / lk (fused chunk, hand-made gradients) against
    speculators' eager tv / lk_hybrid (autograd; its lk_hybrid's eta 3.0 is our lk_eta's
    default), losses and gradients."""
    from eagle3_train.config.train_config import ObjectiveConfig

    ours, theirs = build_pair(seed=7, fc_norm=True, norm_output=True)
    batch = make_batch([31, 22, 27], seed=8)
    their_loss, _ = run_theirs(theirs, batch, loss_fn=their_name)
    objective = ObjectiveConfig(topk_weight=0.0, divergence=ours_name)
    loss, _ = ours(*batch, ttt_steps=TTT, objective=objective)
    torch.testing.assert_close(loss, their_loss.float(), rtol=RTOL, atol=1e-6)
    kl_loss, _ = ours(*batch, ttt_steps=TTT)
    assert not torch.isclose(kl_loss, loss, rtol=1e-3)  # a real difference from KL
    their_loss.backward()
    loss.backward()
    theirs_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, theirs_params[name].grad, rtol=1e-4, atol=1e-6)


def test_step_loss_decay_matches_speculators():
    ours, theirs = build_pair(seed=3)
    batch = make_batch([40, 25], seed=4)
    their_loss, _ = run_theirs(theirs, batch, decay=0.7)
    loss, _ = ours(*batch, ttt_steps=TTT, ttt_step_loss_decay=0.7)
    torch.testing.assert_close(loss, their_loss.float(), rtol=RTOL, atol=1e-6)


def test_cross_document_scoring_is_the_stated_difference():
    """With loss on a document's first rows, speculators' step k>0 also scores the previous
    document's last slots against them; ours does not. Step 0 still agrees."""
    ours, theirs = build_pair(seed=5)
    batch = make_batch([20, 20], seed=6, guard=0)
    mask = batch[3]
    mask[:] = True
    _, metrics = run_theirs(theirs, batch)
    steps = unpack_stats(ours(*batch, ttt_steps=TTT)[1])
    assert float(steps[0].scored) == float(metrics["full_acc_0_total"])
    for k in range(1, TTT):
        # one document boundary: speculators scores k extra slots across it
        assert float(metrics[f"full_acc_{k}_total"]) - float(steps[k].scored) == k
