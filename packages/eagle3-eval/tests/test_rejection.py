"""Rejection sampling keeps the target's distribution: statistical tests on a tiny vocabulary.

Each test draws thousands of outputs with fixed seeds and compares the empirical distribution
with the exact target distribution by Pearson's chi-square; the threshold is the 0.999
quantile, and a deliberately wrong sampler (accept every draft token) must fail it.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3_eval.draft_spec import DraftSpec
from eagle3_eval.reference import DecodeSettings, Request, SpeculativeDecoder, drawn, run_requests
from eagle3_eval.rejection import verify_greedy, verify_sampled
from eagle3_eval.target import Target

from support.drafts import random_draft, speculators_config

CONFIDENCE = 0.999


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: thread hand-offs cost more than the arithmetic (and 2 cores are shared)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def chi_square_pvalue(observed: Counter, expected_probs: dict, n: int) -> float:
    """Pearson's test; outcomes expected fewer than 5 times are pooled (the usual rule)."""
    assert sum(observed.values()) == n and set(observed) <= set(expected_probs)
    cells: list[tuple[float, int]] = []
    pooled_expected, pooled_observed = 0.0, 0
    for outcome, p in expected_probs.items():
        if n * p < 5:
            pooled_expected += n * p
            pooled_observed += observed.get(outcome, 0)
        else:
            cells.append((n * p, observed.get(outcome, 0)))
    if pooled_expected > 0:
        cells.append((pooled_expected, pooled_observed))
    stat = sum((o - e) ** 2 / e for e, o in cells)
    df = len(cells) - 1
    # Survival function of chi-square(df): regularised upper incomplete gamma.
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


# ---- the verification step, context-independent target and draft ------------------------------

P = torch.tensor([[0.5, 0.2, 0.2, 0.1], [0.1, 0.3, 0.2, 0.4], [0.25, 0.25, 0.25, 0.25]])
Q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.1, 0.1, 0.4]])  # the draft's own distributions


def generate_two(
    verify: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[int, int]],
    proposal: str,
    generator: torch.Generator,
) -> tuple[int, int]:
    """Two output tokens; the target's distribution at output position i is P[min(i, 2)]."""
    out: list[int] = []
    while len(out) < 2:
        pos = len(out)
        rows = [min(pos + i, 2) for i in range(3)]
        logits = P[rows].log()
        q = Q[[min(pos + i, 1) for i in range(2)]]
        if proposal == "sample":
            drafts = torch.multinomial(q, 1, generator=generator).flatten()
            accepted, token = verify(logits, drafts, q)
        else:
            drafts = q.argmax(-1)
            accepted, token = verify(logits, drafts, None)
        out += [*drafts[:accepted].tolist(), token]
    return out[0], out[1]


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_verification_preserves_the_target_distribution(proposal: str) -> None:
    generator = torch.Generator().manual_seed(7)

    def verify(logits, drafts, q):
        return verify_sampled(logits, drafts, q, 1.0, generator)

    n = 6000
    observed = Counter(generate_two(verify, proposal, generator) for _ in range(n))
    expected = {(a, b): float(P[0, a] * P[1, b]) for a in range(4) for b in range(4)}
    assert chi_square_pvalue(observed, expected, n) > 1 - CONFIDENCE


def test_a_wrong_sampler_fails_the_same_test() -> None:
    generator = torch.Generator().manual_seed(7)

    def accept_all(logits, drafts, q):
        return len(drafts), int(torch.multinomial(logits[-1].softmax(-1), 1, generator=generator))

    n = 6000
    observed = Counter(generate_two(accept_all, "sample", generator) for _ in range(n))
    expected = {(a, b): float(P[0, a] * P[1, b]) for a in range(4) for b in range(4)}
    assert chi_square_pvalue(observed, expected, n) < 1e-6


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 3.0], [3.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    assert verify_greedy(logits, torch.tensor([1, 2, 0])) == (3, 1)  # all + bonus
    assert verify_greedy(logits, torch.tensor([1, 0, 0])) == (1, 2)  # correction at 1
    assert verify_greedy(logits, torch.tensor([2, 2, 0])) == (0, 1)


# ---- the whole reference loop on a tiny random model ------------------------------------------


def tiny_pair() -> tuple[Target, SpeculativeDecoder, torch.Tensor]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        initializer_range=0.6,  # peaked, position-dependent next-token distributions
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    target = Target(path=None, model=model, tokenizer=None, config=config.to_dict())  # type: ignore[arg-type]
    draft_config = speculators_config(
        target_config=config.to_dict(), verifier_path="", aux_layer_ids=[1, 2], draft_vocab_size=3
    )
    spec = DraftSpec.from_config(draft_config)
    # Draft vocabulary = target ids 0, 1, 3 (d2t offsets 0, 0, 1): exercises the mapping.
    draft = random_draft(spec, model.get_input_embeddings().weight, torch.tensor([0, 0, 1]), 1)
    with torch.no_grad():
        for module in draft.checkpoint_modules().values():
            module.weight.mul_(30)  # a confident (and often wrong) draft
    prompt = torch.tensor([2, 1, 0])
    return target, SpeculativeDecoder(target, draft, k=2), prompt


@pytest.mark.parametrize("proposal", ["greedy", "sample"])
def test_reference_loop_samples_from_the_target(proposal: str) -> None:
    target, decoder, prompt = tiny_pair()
    with torch.no_grad():
        first = target.model(input_ids=prompt[None]).logits[0, -1].softmax(-1)
        expected = {}
        for a in range(4):
            second = target.model(input_ids=torch.cat([prompt, torch.tensor([a])])[None])
            p2 = second.logits[0, -1].softmax(-1)
            for b in range(4):
                expected[(a, b)] = float(first[a] * p2[b])
    n = 800
    observed: Counter = Counter()
    accepted = 0
    for seed in range(n):
        settings = DecodeSettings(2, 1.0, seed, (), proposal)
        counts = decoder.generate(Request(f"s{seed}", prompt.tolist()), settings)
        assert counts.output_token_ids is not None
        observed[tuple(counts.output_token_ids)] += 1
        accepted += counts.num_accepted_tokens
    # Both branches ran: some drafts accepted, some rejected.
    assert 0 < accepted < n
    assert chi_square_pvalue(observed, expected, n) > 1 - CONFIDENCE
    assert set(itertools.chain.from_iterable(observed)) <= set(range(4))


def test_several_draws_per_prompt_keep_the_first_draw_and_differ_after() -> None:
    """--samples N: the first draw of each prompt is the run without copies (same ids, seeds,
    counts); the later draws are other continuations (seeds of their own), not copies of it."""
    _, decoder, prompt = tiny_pair()
    requests = [Request("a", prompt.tolist()), Request("b", [1, 2])]
    tags = {"a": {"turn": 0}, "b": {"turn": 1}}
    settings = DecodeSettings(6, 1.0, 5, (), "greedy")
    once = run_requests(decoder, requests, settings)
    draws, draw_tags = drawn(requests, tags, 8)
    assert [r.sample_id for r in draws[:4]] == ["a", "b", "a#1", "b#1"]
    assert len(draws) == 16 and draw_tags["b#7"] == {"turn": 1}
    many = run_requests(decoder, draws, settings)

    def seen(counts):
        return [(c.sample_id, c.output_token_ids, c.accepted_per_position) for c in counts]

    assert seen(many[:2]) == seen(once)
    # negative control: with one seed for every draw, all 8 continuations of "a" would be one
    outputs = {tuple(c.output_token_ids or []) for c in many if c.sample_id.startswith("a")}
    assert len(outputs) > 1
    with pytest.raises(ValueError, match="draws must be >= 1"):
        drawn(requests, tags, 0)
