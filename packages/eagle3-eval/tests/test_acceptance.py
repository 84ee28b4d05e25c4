"""Acceptance counting: vLLM's +1 convention, per-position and conditional rates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eagle3_eval.acceptance import (
    SampleCounts,
    histogram_from_positions,
    positions_from_histogram,
    summarize,
)


def test_counts_follow_vllm_counters() -> None:
    # Two prompts, k=3. Accepted prefixes per verification step: [3, 1, 0] and [2, 2].
    a = SampleCounts("a", 3)
    for accepted in (3, 1, 0):
        a.observe(3, accepted)
    b = SampleCounts("b", 3)
    for accepted in (2, 2):
        b.observe(3, accepted)
    assert a.accepted_per_position == [2, 1, 1]
    assert b.accepted_per_position == [2, 2, 0]
    s = summarize([a, b], 3)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (5, 15, 8)
    # The "+1" is the target's own token at every step: 1 + 8/5.
    assert s.acceptance_length == pytest.approx(2.6)
    assert s.per_position_acceptance == pytest.approx([4 / 5, 3 / 5, 1 / 5])
    assert s.acceptance_length == pytest.approx(1 + sum(s.per_position_acceptance))
    # Conditional: P(pos i | pos < i accepted) = 4/5, 3/4, 1/3.
    assert s.conditional_acceptance == pytest.approx([4 / 5, 3 / 4, 1 / 3])
    assert s.accepted_histogram == [1, 1, 2, 1]
    assert a.acceptance_length == pytest.approx(1 + 4 / 3)


def test_no_drafts_means_length_one() -> None:
    s = summarize([SampleCounts("a", 2)], 2)
    assert s.acceptance_length == 1.0
    assert s.per_position_acceptance == [0.0, 0.0]
    assert s.conditional_acceptance == [None, None]


def test_impossible_observation_is_refused() -> None:
    counts = SampleCounts("a", 2)
    with pytest.raises(ValueError, match="accepted 3 of 2"):
        counts.observe(2, 3)
    with pytest.raises(ValueError, match="k=2"):
        counts.observe(3, 0)


@given(st.lists(st.integers(0, 4), min_size=1, max_size=50))
def test_histogram_and_positions_are_inverse(accepted: list[int]) -> None:
    counts = SampleCounts("x", 4)
    for a in accepted:
        counts.observe(4, a)
    histogram = counts.histogram()
    assert histogram == [accepted.count(j) for j in range(5)]
    assert positions_from_histogram(histogram) == counts.accepted_per_position
    assert histogram_from_positions(counts.num_drafts, counts.accepted_per_position) == histogram


def test_both_acceptance_length_definitions() -> None:
    """vLLM pools every draft (issue 42508); SpecForge's bench averages per request. A long
    request accepting little and a short one accepting all give two different figures."""
    from eagle3_eval.acceptance import SampleCounts, summarize

    long, short = SampleCounts("long", 2), SampleCounts("short", 2)
    for _ in range(8):
        long.observe(2, 0)  # AL 1.0 over 8 drafts
    short.observe(2, 2)  # AL 3.0 over 1 draft
    idle = SampleCounts("idle", 2)  # no draft at all: no per-request figure to average
    s = summarize([long, short, idle], 2)
    assert s.acceptance_length == pytest.approx(1 + 2 / 9)
    assert s.acceptance_length_per_request == pytest.approx((1.0 + 3.0) / 2)
    assert s.fields()["acceptance_length_per_request"] == pytest.approx(2.0)
