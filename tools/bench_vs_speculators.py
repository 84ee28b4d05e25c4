"""eagle3-train against speculators 0.9.0, where it counts: vLLM-measured acceptance and whole runs.

Both drafts train on the same hidden-state dataset and vocab map (a run of
recipes/tiny/pipeline.sh), for the same optimizer steps and peak learning rate, from the same
packed batches (eagle3-train's epoch plan: seed 0, 2048 tokens, its validation split left out),
then both are served by vLLM (`eagle3-eval vllm`, k = 3, greedy, the same held-out prompts).

- ours: `accelerate launch -m eagle3_train` with recipes/tiny/train.yaml, as a user runs it;
  `--ours-set KEY=VALUE` overrides (ablations).
- speculators: its own training entry point wants CUDA (FlexAttention, fused Triton loss,
  FSDP), so a plain loop around its `Eagle3DraftModel` with the defaults of its eagle3 CLI
  (norm_before_residual / norm_before_fc / norm_output true, AdamW weight decay 0.01, gradient
  clip 1.0, linear schedule) and sdpa attention + eager kl_div loss, saved with its own
  `save_pretrained` — the format vLLM serves.

Whole-run time is start to exported draft of each process (imports, loading, validation,
checkpoints included): what a user waits for. Tokens are the packed tokens of the batches the
steps consume.

    uv run --frozen python tools/bench_vs_speculators.py --run runs/tiny [--steps 150]
    uv run --frozen python tools/bench_vs_speculators.py --run runs/tiny --only ours \\
        --ours-set draft.norm_before_residual=true --tag nbr       # one ablation, vLLM-measured
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "recipes" / "tiny" / "target"
RECIPE = ROOT / "recipes" / "tiny" / "train.yaml"
MAX_TOKENS, SEED, VALIDATION_FRACTION = 2048, 0, 0.05


def epoch_batches(dataset_dir: Path, steps: int) -> list[list[tuple[int, int]]]:
    """The first ``steps`` batches of eagle3-train's plan (epochs repeat with new shuffles)."""
    from eagle3_train.data import HiddenStateDataset, plan_epoch, split_indices

    dataset = HiddenStateDataset(dataset_dir)
    train, _ = split_indices(dataset, VALIDATION_FRACTION)
    batches: list[list[tuple[int, int]]] = []
    epoch = 0
    while len(batches) < steps:
        batches += plan_epoch(dataset.num_tokens, train, MAX_TOKENS, SEED, epoch)
        epoch += 1
    return batches[:steps]


def train_ours(run: Path, out: Path, steps: int, lr: float, overrides: list[str]) -> float:
    sets = [f"data.hidden_states={run / 'hidden_states'}"]
    sets += [f"data.vocab_map={run / 'vocab_map.safetensors'}", f"train.lr={lr}"]
    sets += ["train.progress_bar=false", *overrides]
    command = ["uv", "run", "--frozen", "accelerate", "launch", "--config_file"]
    command += [str(ROOT / "recipes" / "accelerate" / "single.yaml"), "-m", "eagle3_train"]
    command += ["--config", str(RECIPE), "--output-dir", str(out), "--max-steps", str(steps)]
    for s in sets:
        command += ["--set", s]
    began = time.perf_counter()
    _run(command, out.with_suffix(".log"))
    return time.perf_counter() - began


def train_speculators(run: Path, out: Path, steps: int, lr: float) -> float:
    command = [sys.executable, __file__, "--speculators-child", str(run), str(out)]
    command += ["--steps", str(steps), "--lr", str(lr)]
    began = time.perf_counter()
    _run(command, out.with_suffix(".log"))
    return time.perf_counter() - began


def speculators_child(run: Path, out: Path, steps: int, lr: float) -> None:
    """The plain loop (runs in its own process, so its time includes its own imports)."""
    import warnings

    import torch
    from safetensors.numpy import load_file
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.eagle3.data import shift_batch
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig, get_linear_schedule_with_warmup

    from eagle3_train.data import HiddenStateDataset, make_loader, to_device

    torch.manual_seed(SEED)
    dataset = HiddenStateDataset(run / "hidden_states")
    layer = AutoConfig.from_pretrained(TARGET)
    layer.num_hidden_layers = 1
    layer._attn_implementation = "sdpa"  # its FlexAttention default has no CPU backward
    vocab = load_file(str(run / "vocab_map.safetensors"))
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=int(vocab["d2t"].shape[0]),
        norm_before_residual=True,
        norm_before_fc=True,
        norm_output=True,
        eagle_aux_hidden_state_layer_ids=list(dataset.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(TARGET), architectures=layer.architectures),
        ),
    )
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(torch.from_numpy(vocab["t2d"]), torch.from_numpy(vocab["d2t"]))
    model.load_verifier_weights()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    schedule = get_linear_schedule_with_warmup(optimizer, 20, steps)
    loss_config = resolve_loss_config("kl_div", "eager")
    plan = epoch_batches(run / "hidden_states", steps)
    for batch in make_loader(dataset, plan, num_workers=0):
        b = to_device(batch, torch.device("cpu"))
        cu = b["cu_seqlens"].tolist()
        parts = []
        for start, end in itertools.pairwise(cu):  # its own per-document shift
            n = end - start
            parts.append(
                shift_batch(
                    {
                        "input_ids": b["input_ids"][start:end],
                        "hidden_states": b["aux_hidden_states"][start:end].float().reshape(n, -1),
                        "verifier_last_hidden_states": b["last_hidden_state"][start:end].float(),
                        "loss_mask": b["loss_mask"][start:end],
                        "lengths": torch.tensor([n]),
                        "position_ids": torch.arange(n),
                    }
                )
            )
        cat = {k: torch.cat([p[k] for p in parts])[None] for k in parts[0] if k != "lengths"}
        documents = torch.cat([torch.full((len(p["input_ids"]),), i) for i, p in enumerate(parts)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, loss, _ = model(
                hidden_states=cat["hidden_states"],
                input_ids=cat["input_ids"],
                document_ids=documents[None],
                loss_mask=cat["loss_mask"],
                position_ids=cat["position_ids"],
                verifier_last_hidden_states=cat["verifier_last_hidden_states"],
                ttt_steps=3,
                loss_config=loss_config,
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.save_pretrained(str(out / "draft"))


def evaluate(run: Path, draft: Path, out: Path, prompts: int, vllm_python: str) -> dict:
    command = ["uv", "run", "--frozen", "eagle3-eval", "vllm", "--draft", str(draft)]
    command += ["--target", str(TARGET), "--prompts", str(run / "corpus.jsonl")]
    command += ["--heldout-sources", str(TARGET / "build_info.json"), "--limit", str(prompts)]
    command += ["--max-new-tokens", "128", "--concurrency", str(prompts), "--no-baseline"]
    command += ["--ignore-lineage", "--no-figure", "--vllm-python", vllm_python, "--out", str(out)]
    _run(command, out.with_suffix(".log"))
    return json.loads((out / "report.json").read_text())


def _run(command: list[str], log: Path) -> None:
    with log.open("w") as f:
        code = subprocess.call(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"failed (exit {code}): {' '.join(command)}\n" + "\n".join(tail))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", type=Path, help="output folder of recipes/tiny/pipeline.sh")
    p.add_argument("--out", type=Path, help="default: RUN/bench")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--only", choices=["ours", "speculators"])
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--tag", default="", help="suffix of the output folders (ablations)")
    p.add_argument("--vllm-python", default=os.environ.get("EAGLE3_VLLM_PYTHON"))
    p.add_argument("--json", type=Path)
    p.add_argument("--speculators-child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.speculators_child:
        speculators_child(*args.speculators_child, args.steps, args.lr)
        return 0
    if not args.run or not args.vllm_python:
        p.error("--run and a vLLM python (--vllm-python or EAGLE3_VLLM_PYTHON) are required")
    run = args.run.resolve()
    out = (args.out or run / "bench").resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokens = sum(n for batch in epoch_batches(run / "hidden_states", args.steps) for _, n in batch)
    sides = [s for s in ("ours", "speculators") if args.only in (None, s)]
    rows = {}
    for side in sides:
        where = out / f"{side}{'-' + args.tag if args.tag else ''}"
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir()
        if side == "ours":
            seconds = train_ours(run, where / "train", args.steps, args.lr, args.ours_set)
            draft = where / "train" / "draft"
        else:
            seconds = train_speculators(run, where, args.steps, args.lr)
            draft = where / "draft"
        report = evaluate(run, draft, where / "eval", args.prompts, args.vllm_python)
        rows[side] = {
            "acceptance_length": report["acceptance_length"],
            "per_position": report["per_position_acceptance"],
            "conditional": report["conditional_acceptance"],
            "run_seconds": seconds,
            "tokens_per_second": tokens / seconds,
            "overrides": args.ours_set if side == "ours" else [],
        }
    print(f"{args.steps} steps, lr {args.lr}, {tokens} packed tokens, {args.prompts} prompts")
    print(f"{'draft':<14}{'vLLM AL':>9}  {'per position':<22}{'run s':>8}{'tokens/s':>10}")
    for side, r in rows.items():
        positions = " / ".join(f"{x:.3f}" for x in r["per_position"])
        print(
            f"{side:<14}{r['acceptance_length']:>9.3f}  {positions:<22}"
            f"{r['run_seconds']:>8.1f}{r['tokens_per_second']:>10.0f}"
        )
    if len(rows) == 2:
        ours, theirs = rows["ours"], rows["speculators"]
        print(
            f"ours / speculators: AL {ours['acceptance_length'] / theirs['acceptance_length']:.3f}x"
            f", whole-run tokens/s {ours['tokens_per_second'] / theirs['tokens_per_second']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"steps": args.steps, "tokens": tokens, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
