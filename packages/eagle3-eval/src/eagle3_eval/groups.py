"""Figures per prompt set and per category: the report's ``groups``.

Every sample belongs to one prompt set (``--prompts NAME=PATH``) and maybe a category (MT-Bench's).
A set's group holds all its samples (``category`` None); a set with categories also gets one
group per category. Counts add up as vLLM's do, so a group's acceptance length is
1 + its accepted / its drafts, never a mean of per-sample lengths.

Throughput per group needs the generation time of its own samples: the vllm engine batches
prompts within one group at a time and times each group; the reference loop times each
sample. A group's speedup compares its tokens per second with and without the draft.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from eagle3_eval.acceptance import SampleCounts, summarize

GroupKey = tuple[str, str | None]
FIGURES = (
    "num_prompts",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "acceptance_length",
    "acceptance_length_per_request",
    "per_position_acceptance",
)


def sample_group(sample: SampleCounts) -> GroupKey:
    """The finest group of a sample: (set, category), category None when the set has none."""
    return (str(sample.extra["prompt_set"]), sample.extra.get("category"))


def group_keys(samples: Iterable[SampleCounts]) -> list[GroupKey]:
    """Each set (in order of appearance), followed by its categories (sorted)."""
    keys: list[GroupKey] = []
    categories: dict[str, set[str]] = {}
    for s in samples:
        name, category = sample_group(s)
        if (name, None) not in keys:
            keys.append((name, None))
        if category is not None:
            categories.setdefault(name, set()).add(category)
    out: list[GroupKey] = []
    for name, _ in keys:
        out.append((name, None))
        out += [(name, c) for c in sorted(categories.get(name, ()))]
    return out


def members(key: GroupKey, sample: SampleCounts) -> bool:
    name, category = sample_group(sample)
    return name == key[0] and (key[1] is None or category == key[1])


def seconds_of(key: GroupKey, seconds: dict[GroupKey, float]) -> float | None:
    """A group's generation seconds from its finest groups' times; None when untimed."""
    parts = [v for g, v in seconds.items() if g == key or (key[1] is None and g[0] == key[0])]
    return sum(parts) if parts else None


def timed_per_sample(samples: Sequence[SampleCounts]) -> dict[GroupKey, float]:
    """Group times from per-sample seconds (the reference loop runs one sample at a time)."""
    out: dict[GroupKey, float] = {}
    for s in samples:
        if s.seconds is not None:
            out[sample_group(s)] = out.get(sample_group(s), 0.0) + s.seconds
    return out


def group_figures(
    samples: Sequence[SampleCounts],
    k: int,
    seconds: dict[GroupKey, float],
    baseline_tokens: dict[str, int] | None,
    baseline_seconds: dict[GroupKey, float] | None,
) -> list[dict[str, Any]]:
    """The report's ``groups``: each group's summary, tokens/s with and without the draft."""
    out = []
    for key in group_keys(samples):
        mine = [s for s in samples if members(key, s)]
        summary = summarize(mine, k).fields()
        group: dict[str, Any] = {"prompt_set": key[0], "category": key[1]}
        group.update({name: summary[name] for name in FIGURES})
        took = seconds_of(key, seconds)
        tps = summary["num_generated_tokens"] / took if took else None
        base_tps = None
        if baseline_tokens is not None and baseline_seconds is not None:
            base_took = seconds_of(key, baseline_seconds)
            base_tokens = sum(baseline_tokens.get(s.sample_id, 0) for s in mine)
            base_tps = base_tokens / base_took if base_took else None
        group["tokens_per_second"] = tps
        group["baseline_tokens_per_second"] = base_tps
        group["speedup"] = tps / base_tps if tps and base_tps else None
        out.append(group)
    return out


def group_label(group: dict[str, Any]) -> str:
    category = group.get("category")
    return str(group["prompt_set"]) + (f"/{category}" if category is not None else "")
