"""Figures per prompt set and per category: the report's ``groups``; and per kind of traffic
(instant, thinking, agent): its ``kinds``.

Every sample belongs to one prompt set (``--prompts NAME=PATH``) and maybe a category (MT-Bench's).
A set's group holds all its samples (``category`` None); a set with categories also gets one
group per category. Online samples also have a kind (``prompt_files.KINDS``), across sets: a kind's
row holds every sample of that kind. Counts add up as vLLM's do, so a group's acceptance length
is 1 + its accepted / its drafts, never a mean of per-sample lengths.

Throughput per group needs the generation time of its own samples: the vllm engine batches
prompts of one set, category and kind at a time (a ``TimedKey``) and times each batch; the
reference loop times each sample. A group's or kind's seconds are the sum of its timed units'.
A group's speedup compares its tokens per second with and without the draft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

from eagle3_eval.acceptance import SampleCounts, summarize
from eagle3_eval.prompt_files import KINDS

GroupKey = tuple[str, str | None]
TimedKey = tuple[str, str | None, str | None]  # (set, category, kind): timed on its own
# (seconds per timed unit with the draft, each sample's generated tokens without it, seconds per
# timed unit without it; both None without a baseline run)
Timing = tuple[dict[TimedKey, float], dict[str, int] | None, dict[TimedKey, float] | None]
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


def sample_kind(sample: SampleCounts) -> str | None:
    """The sample's kind of traffic; None for offline samples (a dataset, not prompts)."""
    return sample.extra.get("kind")


def is_kind(kind: str, sample: SampleCounts) -> bool:
    return sample_kind(sample) == kind


def members(key: GroupKey, sample: SampleCounts) -> bool:
    name, category = sample_group(sample)
    return name == key[0] and (key[1] is None or category == key[1])


def seconds_of(key: GroupKey, seconds: dict[TimedKey, float]) -> float | None:
    """A group's generation seconds from its timed units' times; None when untimed."""
    parts = [v for g, v in seconds.items() if g[0] == key[0] and key[1] in (None, g[1])]
    return sum(parts) if parts else None


def kind_seconds(kind: str, seconds: dict[TimedKey, float]) -> float | None:
    """A kind's generation seconds from its timed units' times; None when untimed."""
    parts = [v for g, v in seconds.items() if g[2] == kind]
    return sum(parts) if parts else None


def timed_per_sample(samples: Sequence[SampleCounts]) -> dict[TimedKey, float]:
    """Unit times from per-sample seconds (the reference loop runs one sample at a time)."""
    out: dict[TimedKey, float] = {}
    for s in samples:
        if s.seconds is not None:
            key = (*sample_group(s), sample_kind(s))
            out[key] = out.get(key, 0.0) + s.seconds
    return out


def _figures(
    samples: Sequence[SampleCounts],
    k: int,
    timing: Timing,
    member: Callable[[SampleCounts], bool],
    took_of: Callable[[dict[TimedKey, float]], float | None],
) -> dict[str, Any]:
    """A row's summary and tokens/s with and without the draft, from its samples (``member``)
    and their seconds (``took_of`` the timed units' times)."""
    seconds, baseline_tokens, baseline_seconds = timing
    mine = [s for s in samples if member(s)]
    took = took_of(seconds)
    base_took = took_of(baseline_seconds) if baseline_seconds is not None else None
    summary = summarize(mine, k).fields()
    row: dict[str, Any] = {name: summary[name] for name in FIGURES}
    tps = summary["num_generated_tokens"] / took if took else None
    base_tps = None
    if baseline_tokens is not None and base_took:
        base_tps = sum(baseline_tokens.get(s.sample_id, 0) for s in mine) / base_took
    row["tokens_per_second"] = tps
    row["baseline_tokens_per_second"] = base_tps
    row["speedup"] = tps / base_tps if tps and base_tps else None
    return row


def group_figures(samples: Sequence[SampleCounts], k: int, timing: Timing) -> list[dict[str, Any]]:
    """The report's ``groups``: each group's summary, tokens/s with and without the draft."""
    return [
        {"prompt_set": key[0], "category": key[1]}
        | _figures(samples, k, timing, partial(members, key), partial(seconds_of, key))
        for key in group_keys(samples)
    ]


def kind_figures(samples: Sequence[SampleCounts], k: int, timing: Timing) -> list[dict[str, Any]]:
    """The report's ``kinds``: per kind of traffic present, in ``KINDS`` order, the same
    figures as a group's; empty when the samples have no kinds (offline)."""
    present = {sample_kind(s) for s in samples}
    return [
        {"kind": kind}
        | _figures(samples, k, timing, partial(is_kind, kind), partial(kind_seconds, kind))
        for kind in KINDS
        if kind in present
    ]


def group_label(group: dict[str, Any]) -> str:
    category = group.get("category")
    return str(group["prompt_set"]) + (f"/{category}" if category is not None else "")
