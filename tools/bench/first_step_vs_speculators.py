"""One optimizer step of eagle3-train beside one of speculators 0.9.0, as
bench_vs_speculators.py runs them, on the same packed batch from the same weights.

The bench's two runs differ in settings (each one a suspect for the gap between them). This tool makes
ours agree with speculators on every setting a config key reaches (AGREE), starts both from
speculators' initial weights, and compares on the first batch of the bench's plan:

- the loss and each trained tensor's gradient;
- the update of one optimizer step (each side's clip, then its optimizers at their base
  learning rates, the schedules aside) from the same gradient: the optimizers alone; and
  from ours' own gradient, for scale (Newton–Schulz's bf16 iteration magnifies float32
  summation noise in the gradient).

Where the settings agree these agree to float32 summation order (exit 0; 1 otherwise); a
tensor that does not is a difference the settings do not name. Then both sides' learning
rate schedules, step by step: those no config key of ours makes speculators'.

    uv run --frozen python tools/bench/first_step_vs_speculators.py --run runs/tiny [--steps 600]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speculators_loop as speculators
import tiny_runs

# ours' settings that make its step speculators 0.9.0's (speculators/train/config/schema.py,
# the bench's resolution of them): EAGLE 3.1 norms, a frozen LM head, plain KL, step weights
# 1.0, its clip, torch's AdamW betas and Newton-Schulz in bf16 (speculators iterates in bf16 on
# any device; ours in float32 on a CPU unless told)
AGREE = [
    "draft.norm_before_fc=true",
    "draft.norm_output=true",
    "draft.train_lm_head=false",
    "train.objective.topk_weight=0",
    "train.ttt_step_loss_decay=1.0",
    f"train.max_grad_norm={speculators.SPECULATORS_CLIP}",
    "train.betas=[0.9, 0.999]",
    "train.muon.newton_schulz_dtype=bfloat16",
]
# float32 on the same inputs, summed in another order (packed vs per-document, chunked vs
# dense softmax): test_parity.py's bound for losses and gradients
RTOL = 1e-5


def ours_config(recipe: tiny_runs.Recipe, run: Path, steps: int, lr: float, seed: int, extra):
    from eagle3_train.config.run_config import load_config, parse_override

    sets = tiny_runs.ours_sets(run, steps, lr, seed, list(extra))
    return load_config(recipe.train_yaml, [parse_override(s) for s in sets])


def ours_model(config, seed: int):
    from eagle3_train.components.build import build_model
    from eagle3_train.data.inputs import load_inputs, resolve_arch

    inputs = load_inputs(config)
    return build_model(inputs, resolve_arch(inputs), seed)


def ours_loss(model, config, batch) -> torch.Tensor:
    """The trainer's own forward (eagle3_train.data.batch.forward), on the CPU."""
    from eagle3_train.data.batch import forward

    cpu = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    return forward(model, batch, cpu, config)[0]


def trained(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b| (0 where both are 0)."""
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / scale if scale else float((a - b).abs().max())


def step_ours(model, config, start, grads) -> tuple[dict[str, torch.Tensor], float]:
    """One step of ours' optimizer (a fresh one, at its base lrs) from the weights ``start``
    with the gradients ``grads``, after its clip: (update per tensor, norm before the clip)."""
    from eagle3_train.components.build import make_muon

    params = trained(model)
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(start[name])
            param.grad = grads[name].clone()
    limit = config.train.max_grad_norm or float("inf")
    norm = float(torch.nn.utils.clip_grad_norm_(list(params.values()), limit))
    optimizer = make_muon(model, config, cuda=False)  # Newton-Schulz in bf16: AGREE says so
    optimizer.step()
    return {n: p.detach() - start[n] for n, p in params.items()}, norm


def step_speculators(s: speculators.SpeculatorsRun) -> tuple[dict[str, torch.Tensor], float]:
    params = trained(s.model)
    norm = float(torch.nn.utils.clip_grad_norm_(s.model.parameters(), speculators.SPECULATORS_CLIP))
    before = {n: p.detach().clone() for n, p in params.items()}
    for optimizer in s.optimizers:
        for group in optimizer.param_groups:  # its base lr: the schedules are compared apart
            group["lr"] = group["initial_lr"]  # (its schedule made step 0's lr 0: warmup from 0)
        optimizer.step()
    return {n: p.detach() - before[n] for n, p in params.items()}, norm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--recipe", type=Path, default=tiny_runs.ROOT / "recipes" / "tiny")
    p.add_argument("--run", type=Path, required=True, help="output folder of pipeline.sh")
    p.add_argument("--steps", type=int, default=600, help="the run's steps (its schedules)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--arm", default="speculators-muon-lr5e-3", choices=list(speculators.SPECULATORS_ARMS)
    )
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    recipe, run = tiny_runs.Recipe(args.recipe), args.run.resolve()

    from eagle3_train.components.build import lr_lambda
    from eagle3_train.data.dataset import HiddenStateDataset
    from eagle3_train.data.loader import make_loader, to_device

    plan = tiny_runs.epoch_batches(run / "hidden_states", args.steps, args.seed)
    dataset = HiddenStateDataset(run / "hidden_states")
    batch = to_device(next(iter(make_loader(dataset, plan[:1], num_workers=0))), "cpu")
    s = speculators.speculators_run(
        recipe, run, args.steps, args.lr, args.seed, args.arm, len(plan)
    )
    theirs = trained(s.model)
    agree = ours_config(recipe, run, args.steps, args.lr, args.seed, AGREE)
    model = ours_model(agree, args.seed)
    ours = trained(model)
    print(f"batch 0 of seed {args.seed}: {int(batch['input_ids'].shape[0])} tokens")
    print(f"ours' settings made speculators': {'; '.join(AGREE)}")
    if missing := sorted(set(ours) ^ set(theirs)):
        print(f"trained by one side only: {missing}")
        return 1
    print("\ninit (each side's own, before ours takes speculators' weights): std")
    for name in sorted(ours):
        a, b = ours[name].detach(), theirs[name].detach()
        print(f"  {name:<45} ours {float(a.std()):.4f}  speculators {float(b.std()):.4f}")
    with torch.no_grad():
        for name, param in ours.items():
            param.copy_(theirs[name])

    start = {name: param.detach().clone() for name, param in theirs.items()}
    loss_ours, loss_theirs = ours_loss(model, agree, batch), speculators.speculators_loss(s, batch)
    loss_ours.backward()
    loss_theirs.backward()
    worst = relative(loss_ours.detach(), loss_theirs.detach())
    print(f"\nloss: ours {loss_ours.item():.6f}  speculators {loss_theirs.item():.6f}")
    own = {n: param.grad.clone() for n, param in ours.items()}
    given = {n: param.grad.clone() for n, param in theirs.items()}
    update_theirs, norm_theirs = step_speculators(s)
    # the update from speculators' own gradient: the optimizers alone; then from ours'
    # gradient, where Newton–Schulz's bf16 iteration magnifies the gradients' float32 noise
    update_ours, norm_ours = step_ours(model, agree, start, given)
    update_own, _ = step_ours(model, agree, start, own)
    print(f"{'tensor':<45}{'grad rel':>10}{'update rel':>12}{'from ours grad':>16}{'|update|':>10}")
    for name in sorted(ours):
        g = relative(own[name], given[name])
        u = relative(update_ours[name], update_theirs[name])
        worst = max(worst, g, u)
        print(
            f"  {name:<43}{g:>10.2e}{u:>12.2e}{relative(update_own[name], update_theirs[name]):>16.2e}"
            f"{float(update_theirs[name].abs().max()):>10.3e}"
        )
    print(f"gradient norm before the clip: ours {norm_ours:.6f}  speculators {norm_theirs:.6f}")
    verdict = "agree" if worst <= RTOL else "DIFFER"
    print(f"worst relative difference {worst:.2e} (bound {RTOL:g}): the first steps {verdict}")

    defaults = ours_config(recipe, run, args.steps, args.lr, args.seed, [])
    print("\nlr factor (x the group's base lr) of optimizer step k, ours' defaults / speculators':")
    at = [0, 1, 2, 5, 10, 29, 30, args.steps // 4, args.steps // 2, 3 * args.steps // 4]
    ours_lr, theirs_lr = lr_lambda(defaults, args.steps), s.schedules[0].lr_lambdas[0]
    for k in [*at, args.steps - 1]:  # step 0 the first
        print(f"  step {k:>4}: ours {ours_lr(k):.4f}  speculators {theirs_lr(k):.4f}")
    return 0 if worst <= RTOL else 1


if __name__ == "__main__":
    raise SystemExit(main())
