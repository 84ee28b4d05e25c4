"""The GPU check: one command, no network, under 10 minutes on one NVIDIA GPU.

    python3 tools/gpu_check.py --json gpu_check.json

1. Training step, bf16 autocast over fp32 master weights, ours vs speculators 0.9.0 at the
   same config (tools/bench_train.py, each side in its own process): tokens/s and the GPU's
   peak memory, at a Llama-3.1-8B draft's shape and at a Kimi-K2.5 draft's shape
   (recipes/kimi-k2.5/train.yaml: H 7168, 64 heads, V 163,840 -> 32,000).
2. vLLM on CUDA, where vllm imports: the project's vLLM tests run on this GPU,
   - extraction parity with transformers on the tiny Llama target
     (packages/eagle3-extract/tests/test_vllm_backend.py) and on the tiny DeepseekV3-shaped
     Kimi stand-in (tests/test_kimi_recipe.py::test_vllm_extraction_of_the_wrapper...),
   - the tiny draft's acceptance length measured by vLLM (packages/eagle3-eval/tests/test_vllm.py),
   each reported passed / failed / xfailed; without vllm the rows say why they did not run.

Prints one table and writes it as JSON. Needs torch with CUDA, transformers, accelerate,
speculators (and vllm for part 2); the project's packages run from source.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = [REPO / "packages" / p / "src" for p in ("eagle3-schemas", "eagle3-train", "eagle3-extract", "eagle3-eval", "eagle3-data")]  # fmt: skip

# (name, bench_train.py arguments): drafts of real targets, T packed tokens per step.
TRAIN_CONFIGS = {
    "llama-3.1-8b draft": [
        "--hidden=4096", "--heads=32", "--intermediate=14336", "--v-target=128256",
        "--v-draft=32000", "--tokens=8192", "--doc-len=2048",
    ],
    "kimi-k2.5 draft": [
        "--hidden=7168", "--heads=64", "--intermediate=18432", "--v-target=163840",
        "--v-draft=32000", "--tokens=8192", "--doc-len=2048",
    ],
}  # fmt: skip

VLLM_TESTS = {
    "vLLM extraction = transformers (tiny Llama)": "packages/eagle3-extract/tests/test_vllm_backend.py",
    "vLLM extraction = transformers (Kimi stand-in, MLA+MoE)": "tests/test_kimi_recipe.py::test_vllm_extraction_of_the_wrapper_matches_transformers",
    "vLLM serves the MLA draft beside the Kimi stand-in": "tests/test_kimi_recipe.py::test_vllm_serves_the_mla_draft_and_agrees_with_the_reference",
    "vLLM acceptance length of the tiny draft": "packages/eagle3-eval/tests/test_vllm.py",
}  # fmt: skip


def _env() -> dict[str, str]:
    path = [str(p) for p in SOURCES] + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def environment() -> dict[str, object]:
    import torch

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "python": sys.version.split()[0],
        **{p: version(p) for p in ("torch", "transformers", "accelerate", "speculators", "vllm")},
    }


def train_step(name: str, args: list[str], steps: int) -> dict[str, object]:
    command = [
        sys.executable, str(REPO / "tools" / "bench_train.py"), "--device=cuda",
        "--dtype=bfloat16", "--rounds=1", "--warmup=2", f"--steps={steps}", "--skip-loader",
        "--threads=8", *args,
    ]  # fmt: skip
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        done = subprocess.run(
            [*command, f"--json={report}"], env=_env(), capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            return {"config": name, "error": (done.stderr or done.stdout)[-2000:]}
        results = json.loads(report.read_text())
    ours, theirs = results["ours"], results["speculators"]
    tokens = results["config"]["tokens"]
    return {
        "config": name,
        "tokens_per_step": tokens,
        "ours_tokens_per_s": round(ours["tokens_per_s"]),
        "speculators_tokens_per_s": round(theirs["tokens_per_s"]),
        "speed_vs_speculators": round(ours["tokens_per_s"] / theirs["tokens_per_s"], 3),
        "ours_peak_gib": round(ours["peak_gpu_mib"] / 1024, 2),
        "speculators_peak_gib": round(theirs["peak_gpu_mib"] / 1024, 2),
        "ours_peak_kib_per_token": round(ours["peak_gpu_mib"] * 1024 / tokens, 1),
        "memory_vs_speculators": round(ours["peak_gpu_mib"] / theirs["peak_gpu_mib"], 3),
        "seconds": round(time.perf_counter() - start, 1),
    }


def vllm_tests(out_dir: Path) -> list[dict[str, object]]:
    if importlib.util.find_spec("vllm") is None:
        why = "not run: vllm does not import here (install vllm for CUDA to run this part)"
        return [{"check": name, "outcome": why} for name in VLLM_TESTS]
    rows = []
    env = {**_env(), "EAGLE3_VLLM_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    for name, selection in VLLM_TESTS.items():
        report = out_dir / "junit.xml"
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "vllm", "-p", "no:cacheprovider",
             f"--junitxml={report}", selection],
            cwd=REPO, env=env, capture_output=True, text=True, check=False, timeout=600,
        )  # fmt: skip
        outcomes = []
        for case in ET.parse(report).iter("testcase"):
            kinds = [child.tag for child in case]
            outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
            detail = next((c.get("message", "") for c in case if c.tag == outcome), "")
            outcomes.append(f"{case.get('name')}: {outcome} {detail[:200]}".strip())
        seconds = round(time.perf_counter() - start, 1)
        rows.append({"check": name, "outcome": "; ".join(outcomes), "seconds": seconds})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per side")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument(
        "--configs", nargs="*", help=f"train configs (default all: {list(TRAIN_CONFIGS)})"
    )
    parser.add_argument(
        "--tf32", nargs="+", type=int, default=[1], help="train.tf32 settings to run"
    )
    parser.add_argument(
        "--attention",
        nargs="+",
        choices=["chunked", "sdpa"],
        help="draft.attention of ours at every shape (default: chunked; sdpa too at the first)",
    )
    args = parser.parse_args()
    env = environment()
    if not env["gpu"]:
        print("gpu_check: no CUDA device is visible", file=sys.stderr)
        return 2
    print(json.dumps(env))
    chosen = {k: v for k, v in TRAIN_CONFIGS.items() if not args.configs or k in args.configs}
    # default: the recipes' chunked attention everywhere, sdpa at the first shape as a probe
    runs = [
        (name, attention)
        for i, name in enumerate(chosen)
        for attention in (args.attention or (["chunked", "sdpa"] if i == 0 else ["chunked"]))
    ]
    train = [
        train_step(
            f"{name}, {attention}, tf32={tf32}",
            [*chosen[name], f"--tf32={tf32}", f"--attention={attention}"],
            args.steps,
        )
        for name, attention in runs
        for tf32 in args.tf32
    ]
    vllm = [] if args.skip_vllm else vllm_tests(args.json.resolve().parent)
    print(
        f"\nGPU check on {env['gpu']} (torch {env['torch']}, speculators {env['speculators']}, vllm {env['vllm']})"
    )
    print(
        f"{'train step, bf16':44}{'ours tok/s':>12}{'spec tok/s':>12}{'speed':>8}{'ours GiB':>10}{'spec GiB':>10}{'memory':>8}"
    )
    for row in train:
        if "error" in row:
            print(f"{row['config']:44} error: {str(row['error']).splitlines()[-1]}")
            continue
        print(
            f"{row['config']:44}{row['ours_tokens_per_s']:>12}{row['speculators_tokens_per_s']:>12}"
            f"{row['speed_vs_speculators']:>8.2f}{row['ours_peak_gib']:>10.2f}"
            f"{row['speculators_peak_gib']:>10.2f}{row['memory_vs_speculators']:>8.2f}"
        )
    for row in vllm:
        print(f"{row['check']}: {row['outcome']}")
    args.json.write_text(json.dumps({"environment": env, "train": train, "vllm": vllm}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
