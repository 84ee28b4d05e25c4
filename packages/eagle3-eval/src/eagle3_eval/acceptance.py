"""Acceptance counts, kept the way vLLM's spec-decode counters keep them.

Per verification step ("draft") vLLM adds 1 to ``num_drafts``, the number of proposed tokens
to ``num_draft_tokens``, the accepted prefix length a to ``num_accepted_tokens``, and 1 to
``num_accepted_tokens_per_pos[i]`` for every i < a. Hence

    acceptance_length = 1 + num_accepted_tokens / num_drafts
    per_position_acceptance[i] = num_accepted_tokens_per_pos[i] / num_drafts
    acceptance_length = 1 + sum(per_position_acceptance)

That is the pooled acceptance length (vLLM's, the headline). SpecForge's bench averages each
request's own ``1 + accepted / drafts`` instead (``acceptance_length_per_request``); the two
differ whenever requests differ in length and acceptance, so both are reported, each named
(eagle3_schemas.layouts.model_card.ACCEPTANCE_DEFINITIONS).

The "+1" is the token the target adds at every step (the correction or bonus token). Accepted
tokens are a prefix, so ``per_position_acceptance`` is non-increasing and the histogram of
accepted lengths follows from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SampleCounts:
    """One prompt's (or one held-out sample's) counters."""

    sample_id: str
    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0
    seconds: float | None = None
    output_token_ids: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens
        if len(self.accepted_per_position) != self.num_speculative_tokens:
            raise ValueError(
                f"{self.sample_id}: {len(self.accepted_per_position)} per-position counts for "
                f"k={self.num_speculative_tokens}"
            )

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verification step: ``num_accepted`` of ``num_draft_tokens`` drafts accepted."""
        if not 0 <= num_accepted <= num_draft_tokens <= self.num_speculative_tokens:
            raise ValueError(
                f"{self.sample_id}: accepted {num_accepted} of {num_draft_tokens} drafts "
                f"(k={self.num_speculative_tokens})"
            )
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def num_accepted_tokens(self) -> int:
        return sum(self.accepted_per_position)

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def histogram(self) -> list[int]:
        """Drafts with exactly j tokens accepted, j = 0..k."""
        return histogram_from_positions(self.num_drafts, self.accepted_per_position)


def histogram_from_positions(num_drafts: int, per_position: Sequence[int]) -> list[int]:
    """Accepted prefixes: drafts with >= i+1 accepted are per_position[i]; take differences."""
    at_least = [num_drafts, *per_position, 0]
    return [at_least[j] - at_least[j + 1] for j in range(len(per_position) + 1)]


def positions_from_histogram(histogram: Sequence[int]) -> list[int]:
    """Inverse of ``histogram_from_positions``: per_position[i] = drafts with > i accepted."""
    return [sum(histogram[i + 1 :]) for i in range(len(histogram) - 1)]


@dataclass(frozen=True)
class Summary:
    acceptance_length_per_request: float | None  # first: the report's field order
    num_speculative_tokens: int
    num_prompts: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_generated_tokens: int
    acceptance_length: float
    per_position_acceptance: list[float]
    conditional_acceptance: list[float | None]
    accepted_histogram: list[int]

    def fields(self) -> dict[str, Any]:
        return asdict(self)


def summarize(samples: Sequence[SampleCounts], k: int) -> Summary:
    drafts = sum(s.num_drafts for s in samples)
    per_position_counts = [sum(s.accepted_per_position[i] for s in samples) for i in range(k)]
    accepted = sum(per_position_counts)
    per_position = [c / drafts if drafts else 0.0 for c in per_position_counts]
    # P(position i accepted | positions < i accepted): what a draft step "costs" at depth i.
    previous = [drafts, *per_position_counts[:-1]]
    conditional = [c / p if p else None for c, p in zip(per_position_counts, previous, strict=True)]
    per_request = [s.acceptance_length for s in samples if s.num_drafts]
    return Summary(
        acceptance_length_per_request=sum(per_request) / len(per_request) if per_request else None,
        num_speculative_tokens=k,
        num_prompts=len(samples),
        num_drafts=drafts,
        num_draft_tokens=sum(s.num_draft_tokens for s in samples),
        num_accepted_tokens=accepted,
        num_generated_tokens=sum(s.num_generated_tokens for s in samples),
        acceptance_length=1 + accepted / drafts if drafts else 1.0,
        per_position_acceptance=per_position,
        conditional_acceptance=conditional,
        accepted_histogram=histogram_from_positions(drafts, per_position_counts),
    )
