"""eagle3-recipe: ``plan`` prints a recipe's every decision with its reason; ``new`` writes it.

Exit statuses: 0 planned (or written), 2 refused before any work (the message names the file
and field, or the flag, and what would fit).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from eagle3_recipe.gpus import GPUS
from eagle3_recipe.plan import Request, make_plan, plan_text
from eagle3_recipe.target import PlanError
from eagle3_recipe.write import write_recipe
from eagle3_schemas.runtime.options import config_from_args

UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "GIB": 2**30, "TIB": 2**40}


def disk_size(text: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: a size such as 500GB or 2TB")
    return float(match.group(1)) * UNITS[match.group(2).upper()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="eagle3-recipe", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("plan", "print the recipe's decisions, each with its reason, and the totals"),
        ("new", "write the recipe folder (flags.sh, train.yaml, pipeline.sh)"),
    ):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--target", type=Path, required=True, help="the model directory")
        s.add_argument("--gpus", type=int, default=8, help="GPUs per node (default 8)")
        s.add_argument("--gpu", required=True, choices=sorted(GPUS), help="the GPU kind")
        s.add_argument("--gpu-memory", type=float, help="GiB per GPU (overrides the table's)")
        s.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
        s.add_argument("--disk-budget", type=disk_size, help="disk for hidden states, e.g. 2TB")
        s.add_argument("--max-length", type=int, help="tokens per sample (default: planned)")
        s.add_argument("--json", type=Path, help="also write the plan as JSON here")
        if name == "new":
            s.add_argument("--name", help="the recipe's name (default: the model folder's)")
            s.add_argument("--hub-id", help="the verifier's hub id (default: the name)")
            s.add_argument("--out", type=Path, help="recipes/NAME of this repository (default)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    request = config_from_args(
        Request, args, gpu_memory_gib=args.gpu_memory, disk_budget_bytes=args.disk_budget
    )
    try:
        plan = make_plan(request)
        if args.command == "new":
            name = args.name or args.target.resolve().name
            out = write_recipe(plan, name, args.hub_id or name, args.out)
    except PlanError as exc:
        print(f"eagle3-recipe {args.command}: refused: {exc}", file=sys.stderr)
        return 2
    print(plan_text(plan), end="")
    if args.json:
        args.json.write_text(json.dumps(plan.to_json(), indent=2) + "\n", encoding="utf-8")
    if args.command == "new":
        script = f"bash recipes/{out.name}/pipeline.sh"
        if args.gpu != "cpu":
            script = f"MODEL={args.target} DATA=chats.jsonl HELDOUT=heldout.jsonl {script}"
        print(f"\nwrote {out}; from the repository root, run:\n  {script}")
    return 0
