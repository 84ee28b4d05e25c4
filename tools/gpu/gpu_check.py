"""The GPU check: one command, no network, under 10 minutes on one NVIDIA GPU.

    bash tools/gpu/gpu_wheels.sh    # once, with network: .whl/ (wheels a bare CUDA image lacks)
    bash tools/gpu/gpu_check.sh     # on the GPU node, .whl/ copied beside the repository: installs
                                    # them, runs this script, writes $OUT/gpu_check.{json,log}
    python tools/gpu/gpu_check.py --plan               # the parts, their order and budgets
    python tools/gpu/gpu_check.py --device cpu         # a rehearsal on CPU (small shapes)

The parts (PARTS, most valuable first; what each measures: docs/gpu-check.md) each run in
their own process group with a timeout of the budget left, are skipped with their reason when
their cost does not fit, and the JSON is written again after each one, so a run cut short keeps
what it measured. A training row is one bench_train.py run (each side in its own process; ours
as eagle3-train runs on CUDA); the other parts are in check_parts.py.

On CPU (``--device cpu``) every part runs at small shapes, float32 and not compiled: a
rehearsal of the whole script within its budget, and the measured seconds of each part.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # check_parts.py, wheels_to_install.py
from check_parts import REPO, attention_check, source_env, vllm_tests, whole_run
from wheels_to_install import installed_version

# bench_train.py arguments of each draft shape: on CUDA the real drafts' (T packed tokens per
# step), on CPU a small stand-in that runs the same code in seconds.
SHAPE_FLAGS = ("hidden", "heads", "intermediate", "v-target", "v-draft", "tokens", "doc-len")
SHAPES = {
    "cuda": {
        "llama": (4096, 32, 14336, 128256, 32000, 8192, 2048),
        "kimi": (7168, 64, 18432, 163840, 32000, 8192, 2048),
        "long": (4096, 32, 14336, 128256, 32000, 32768, 32768),
    },
    "cpu": {
        "llama": (256, 4, 896, 8192, 1024, 1024, 256),
        "kimi": (512, 8, 1152, 16384, 1024, 1024, 256),
        "long": (256, 4, 896, 8192, 1024, 4096, 4096),
    },
}
# how each device runs the step: CUDA as eagle3-train does (bf16 autocast over fp32 masters);
# the CPU rehearsal in float32 (CPU bf16 and inductor's CPU compile would take its budget)
RUN = {
    "cuda": ["--device=cuda", "--dtype=bfloat16", "--threads=8", "--warmup=3"],
    "cpu": ["--device=cpu", "--dtype=float32", "--threads=2", "--warmup=1"],
}
ATTENTION_TOKENS = {"cuda": 8192, "cpu": 1024}


@dataclass(frozen=True)
class Part:
    key: str
    title: str
    # seconds, per device kind. CUDA: from the CPU rehearsal's measured phases per side
    # process (imports ~6 s ours, ~15 s speculators; building on the device, no CPU randn),
    # plus CUDA start-up (~5 s), inductor's compile of the layer and the loss chunk (~60 s)
    # and speculators' FlexAttention compile (~30 s) in the warm-up, the timed steps (< 5 s),
    # the sync/pageable/profile steps (~10 s). CPU: the rehearsal's measured part seconds.
    cost_s: dict[str, float]
    bench: list[str] | None = None  # a training row: [shape, bench_train.py arguments...]


# The recipes' settings (what a user's step runs): train: defaults' objective, Muon + AdamW as
# the GPU recipes set it, the LM head trained, every token of the documents scored; beside it
# speculators 0.9.0 at its defaults (Muon on the matrices, AdamW on the rest, its LM head frozen).
RECIPE = ["--objective=defaults", "--optimizer=muon", "--head=trained", "--scored=1"]
# The earlier rows' settings, for continuity: speculators' plain TTT objective, AdamW, the head
# frozen on both sides, 3/4 of each document scored.
BENCH = ["--objective=plain", "--optimizer=adamw", "--head=frozen", "--scored=0.75"]

PARTS = [
    Part("attention", "flash vs chunked TTT attention", {"cuda": 30, "cpu": 20}),
    Part("llama", "llama-3.1-8b draft, the recipes' settings: ours vs speculators", {"cuda": 180, "cpu": 50},
         ["llama", *RECIPE, "--sides=both", "--attention=auto", "--compile=1", "--sync-check=1",
          "--profile=1"]),
    # ~10 processes (torch imported in each, CUDA started in 3), the tiny model's work small
    Part("whole", "whole tiny run (train.compile=never)", {"cuda": 120, "cpu": 135}),
    Part("kimi", "kimi-k2.5 draft, the recipes' settings: ours vs speculators", {"cuda": 210, "cpu": 55},
         ["kimi", *RECIPE, "--sides=both", "--attention=auto", "--compile=1", "--profile=1"]),
    Part("long", "llama draft, one long sample (32K on CUDA), the recipes' settings", {"cuda": 160, "cpu": 85},
         ["long", *RECIPE, "--sides=both", "--attention=auto", "--compile=1", "--profile=1"]),
    Part("llama-bench", "llama draft, the earlier rows' settings: ours vs speculators", {"cuda": 170, "cpu": 45},
         ["llama", *BENCH, "--sides=both", "--attention=auto", "--compile=1"]),
    Part("eager", "llama draft: ours, the recipes' settings, not compiled", {"cuda": 45, "cpu": 15},
         ["llama", *RECIPE, "--sides=ours", "--attention=auto", "--compile=0"]),
    Part("chunked", "llama draft: ours, chunked attention, eager", {"cuda": 50, "cpu": 15},
         ["llama", *RECIPE, "--sides=ours", "--attention=chunked", "--compile=0", "--profile=1"]),
    Part("vllm", "vLLM on CUDA", {"cuda": 600, "cpu": 0}),
]  # fmt: skip
REPORT_RESERVE_S = 10  # kept back from the budget for the last write and the table


def environment() -> dict[str, object]:
    import torch

    try:  # what the speculators rows need (through openai: httpx2, httpcore2, truststore)
        importlib.import_module("speculators.models.eagle3")
        speculators_import = "ok"
    except Exception as e:  # reported: the rows' speculators side will fail the same way
        speculators_import = f"{type(e).__name__}: {e}"[:300]
    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        **{p: installed_version(p) for p in ("torch", "transformers", "accelerate", "speculators")},
        "vllm": installed_version("vllm"),
        "speculators_import": speculators_import,
    }


# --- the parts (each runs in a child process: this script with --run-part) -----------------


def shape_args(device: str, shape: str) -> list[str]:
    """bench_train.py's arguments of a draft shape on a device."""
    values = SHAPES[device][shape]
    return [f"--{flag}={value}" for flag, value in zip(SHAPE_FLAGS, values, strict=True)]


def train_row(part: Part, device: str, steps: int, deadline: float) -> dict[str, object]:
    """One bench_train.py run (each side in its own process) as a table row."""
    assert part.bench is not None
    shape, *extra = part.bench
    command = [
        sys.executable, str(REPO / "tools" / "bench" / "bench_train.py"), *RUN[device],
        "--rounds=1", f"--steps={steps}", "--skip-loader", *shape_args(device, shape), *extra,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        try:
            done = subprocess.run(
                [*command, f"--json={report}"], env=source_env(), capture_output=True, text=True,
                check=False, timeout=max(1.0, deadline - time.time()),
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": "timed out at the end of the budget (bench_train.py)"}
        if done.returncode != 0 or not report.exists():
            return {"error": (done.stderr or done.stdout)[-2000:]}
        results = json.loads(report.read_text())
    tokens = results["config"]["tokens"]
    row: dict[str, object] = {"tokens_per_step": tokens, "objective": results["config"]["objective"]}  # fmt: skip
    for side in ("ours", "speculators"):
        r = results.get(side)
        if r is None:
            continue
        if "error" in r:
            row[f"{side}_error"] = r["error"]
            continue
        peak_mib = r.get("peak_gpu_mib", r["peak_rss_mib"])
        row[f"{side}_tokens_per_s"] = round(r["tokens_per_s"])
        row[f"{side}_mfu"] = round(r["mfu"], 3) if "mfu" in r else None
        row[f"{side}_peak_gib"] = round(peak_mib / 1024, 2)
        row[f"{side}_peak_kib_per_token"] = round(peak_mib * 1024 / tokens, 1)
        row[f"{side}_phases_s"] = r.get("phases_s")
    if "ours_tokens_per_s" in row and "speculators_tokens_per_s" in row:
        row["speed_vs_speculators"] = round(
            row["ours_tokens_per_s"] / row["speculators_tokens_per_s"], 3
        )  # type: ignore[operator]
        row["memory_vs_speculators"] = round(row["ours_peak_gib"] / row["speculators_peak_gib"], 3)  # type: ignore[operator]
    ours = results.get("ours", {})
    for key in ("host_syncs_in_step", "pageable_copies_in_step", "top_kernels"):
        if key in ours:
            row[key] = ours[key]
    return row


def run_part(key: str, device: str, args: argparse.Namespace) -> dict[str, object]:
    """One part's row, computed in this (child) process."""
    part = next(p for p in PARTS if p.key == key)
    if part.bench is not None:
        return train_row(part, device, args.steps, args.deadline)
    if key == "attention":
        return attention_check(device, ATTENTION_TOKENS[device])
    if key == "whole":
        with tempfile.TemporaryDirectory() as tmp:
            return whole_run(
                Path(tmp) / "tiny", device, args.whole_samples, args.whole_steps, args.deadline
            )
    if key == "vllm":
        with tempfile.TemporaryDirectory() as tmp:
            return vllm_tests(Path(tmp), args.deadline)
    raise ValueError(f"unknown part {key!r}")


# --- the plan and the parent -------------------------------------------------------------


def plan(parts: list[Part], device: str, budget_s: float) -> list[dict[str, object]]:
    """Each part with its estimated cost and the budget left when it would start, in order:
    a part whose cost does not fit what is left is planned as skipped."""
    left = budget_s - REPORT_RESERVE_S
    rows = []
    for part in parts:
        cost = part.cost_s[device]
        fits = cost <= left
        rows.append({"part": part.key, "title": part.title, "cost_s": cost, "left_s": round(left), "fits": fits})  # fmt: skip
        if fits:
            left -= cost
    return rows


def _run_child(
    key: str, args: argparse.Namespace, device: str, timeout: float
) -> dict[str, object]:
    """The part in a child process of its own group, killed with all it started (bench
    sides, pipeline stages) when ``timeout`` (the budget left) runs out."""
    with tempfile.TemporaryDirectory() as tmp:
        row_json = Path(tmp) / "row.json"
        command = [
            sys.executable, __file__, "--run-part", key, "--device", device,
            # the child's own deadline a little earlier: it names the stage that ran out
            "--row-json", str(row_json), "--deadline", str(time.time() + timeout - 3),
            "--steps", str(args.steps), "--whole-samples", str(args.whole_samples),
            "--whole-steps", str(args.whole_steps),
        ]  # fmt: skip
        child = subprocess.Popen(
            command, env=source_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            output, _ = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return {"error": f"timed out: the budget left ({timeout:.0f} s) ran out"}
        with contextlib.suppress(ProcessLookupError):  # what the child left running (a
            os.killpg(child.pid, signal.SIGKILL)  # bench side after its own timeout) goes too
        if row_json.exists():
            return json.loads(row_json.read_text())
        return {"error": f"exit {child.returncode}: {output[-2000:]}"}


def _write_json(path: Path, results: dict[str, object]) -> None:
    """Atomically (a cut-short run leaves the last whole table, never half of one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per side")
    keys = [p.key for p in PARTS]
    parser.add_argument("--parts", nargs="+", default=keys, choices=keys, metavar="PART")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a rehearsal on CPU, small shapes")  # fmt: skip
    parser.add_argument(
        "--budget-s", type=float, default=555,
        help="the whole call's seconds (600 a command, less gpu_check.sh's install and start)",
    )  # fmt: skip
    parser.add_argument("--plan", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--whole-samples", type=int, default=64)
    parser.add_argument("--whole-steps", type=int, default=24)
    parser.add_argument("--run-part", help=argparse.SUPPRESS)
    parser.add_argument("--row-json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_part:  # the child: one part's row
        try:
            row = run_part(args.run_part, args.device, args)
        except Exception as e:  # the row names it; the parent goes on to the next part
            row = {"error": f"{type(e).__name__}: {e}"[-3000:]}
        _write_json(args.row_json, row)
        return 0

    started = time.perf_counter()
    parts = [p for p in PARTS if p.key in args.parts]
    planned = plan(parts, args.device, args.budget_s)
    print(f"plan ({args.device}, budget {args.budget_s:.0f} s, {REPORT_RESERVE_S} s kept for the report):")  # fmt: skip
    for p in planned:
        verdict = "runs" if p["fits"] else "skipped unless earlier parts finish early"
        print(f"  {p['part']:10} ~{p['cost_s']:>4.0f} s of {p['left_s']:>4} s left  {p['title']}  ({verdict})")  # fmt: skip
    if args.plan:
        return 0
    env = environment()
    if args.device == "cuda" and not env["gpu"]:
        print("gpu_check: no CUDA device is visible", file=sys.stderr)
        return 2
    print(json.dumps(env), flush=True)
    results: dict[str, object] = {"environment": env, "plan": planned, "parts": {}}
    rows: dict[str, dict[str, object]] = results["parts"]  # type: ignore[assignment]
    for part in parts:
        left = args.budget_s - REPORT_RESERVE_S - (time.perf_counter() - started)
        cost = part.cost_s[args.device]
        start = time.perf_counter()
        if part.key == "vllm" and importlib.util.find_spec("vllm") is None:
            row: dict[str, object] = {
                "skipped": "vllm does not import in this Python (the image has none)"
            }
        elif cost > left:
            row = {"skipped": f"~{cost:.0f} s needed, {left:.0f} s of the budget left"}
        else:
            row = _run_child(part.key, args, args.device, left)
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows[part.key] = row
        print(f"{part.key}: {json.dumps({k: v for k, v in row.items() if k != 'top_kernels'})}", flush=True)  # fmt: skip
        _write_json(args.json, results)
    results["seconds"] = round(time.perf_counter() - started, 1)
    _write_json(args.json, results)
    report(results)
    return 0


def report(results: dict[str, object]) -> None:
    env: dict = results["environment"]  # type: ignore[assignment]
    rows: dict[str, dict] = results["parts"]  # type: ignore[assignment]
    memory = "GiB" if env["gpu"] else "GiB RSS"
    print(
        f"\nGPU check on {env['gpu'] or 'cpu (rehearsal)'} (torch {env['torch']}, speculators "
        f"{env['speculators']}: import {env['speculators_import']}, vllm {env['vllm']}), "
        f"{results['seconds']} s"
    )
    print(f"{'part':10}{'ours tok/s':>11}{'spec tok/s':>11}{'speed':>7}{'ours ' + memory:>13}{'spec ' + memory:>13}{'memory':>8}{'s':>7}  note")  # fmt: skip
    titles = {p.key: p.title for p in PARTS}

    def cell(row: dict, name: str, width: int, fmt: str = "") -> str:
        value = row.get(name)
        return f"{format(value, fmt) if value is not None else '-':>{width}}"

    for key, row in rows.items():
        note = row.get("skipped") or row.get("error") or titles[key]
        if key == "attention" and "problems" in row:
            note = "; ".join(row["problems"]) or (
                f"flash = chunked (values, gradients; moved key caught); fwd+bwd at T "
                f"{row['tokens']}: flash {row['flash_fwd_bwd_ms']} ms, chunked {row['chunked_fwd_bwd_ms']} ms"
            )
        elif key == "whole" and "train_tokens_per_s_whole_launches" in row:
            note = (
                f"{row['train_steps']} steps (resumed at {row['resumed_from_step']}), launches "
                f"{row['train_tokens_per_s_whole_launches']} tok/s, logged {row['train_tokens_per_s_logged']} "
                f"tok/s, loss {row['final_loss']}, reference AL {row['acceptance_length_reference']}"
            )
        elif key == "vllm" and "checks" in row:
            note = "; ".join(f"{c['check']}: {c['outcome']}" for c in row["checks"])
        for side in ("ours", "speculators"):
            if f"{side}_error" in row:
                note = f"{side}: {row[f'{side}_error']}; {note}"
        print(
            f"{key:10}{cell(row, 'ours_tokens_per_s', 11)}{cell(row, 'speculators_tokens_per_s', 11)}"
            f"{cell(row, 'speed_vs_speculators', 7, '.2f')}{cell(row, 'ours_peak_gib', 13, '.2f')}"
            f"{cell(row, 'speculators_peak_gib', 13, '.2f')}{cell(row, 'memory_vs_speculators', 8, '.2f')}"
            f"{row['seconds']:>7.0f}  {str(note).strip().splitlines()[-1][:300] if note else ''}"
        )
        if row.get("host_syncs_in_step"):
            print(
                f"  host syncs in one step (sync debug mode 'error'): {row['host_syncs_in_step']}"
            )
        if row.get("pageable_copies_in_step"):
            print(f"  host→device copies from pageable memory: {row['pageable_copies_in_step']}")
        for name, ms, calls in row.get("top_kernels") or []:
            print(f"  {ms:>9.2f} ms {calls:>5}x  {name}")


if __name__ == "__main__":
    sys.exit(main())
