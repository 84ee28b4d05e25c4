"""The GPU check: one command, no network, under 10 minutes on one NVIDIA GPU.

    bash tools/gpu/gpu_wheels.sh    # once, here: .whl/ (7 MiB of wheels the bare CUDA image lacks)
    bash tools/gpu/gpu_check.sh     # there (device tool: carry [".whl"], timeout_s 600): installs
                                # them, runs this script, writes $OUT/gpu_check.{json,log}

1. Attention: the flash TTT path on this GPU against the chunked reference (values and
   gradients within 8·u of bf16, a moved diagonal key that must fail), and both paths'
   forward+backward time at the Llama-3.1-8B draft's shape.
2. Training step, bf16 autocast over fp32 master weights, ours (draft.attention auto, the
   layers compiled, as eagle3-train runs on CUDA) vs speculators 0.9.0 at the same config
   (tools/bench/bench_train.py, each side in its own process): tokens/s, MFU and the GPU's peak
   memory at a Llama-3.1-8B draft's shape and at a Kimi-K2.5 draft's shape
   (recipes/kimi-k2.5/train.yaml: H 7168, 64 heads, V 163,840 -> 32,000); at the first shape
   one step under torch.cuda.set_sync_debug_mode("error") (host syncs inside a step) and the
   profile's top CUDA kernels; then probes (not compiled; the chunked path).
3. The whole tiny run on this GPU: corpus → eagle3-data ingest/tokenize/vocab →
   eagle3-extract run --device cuda (transformers) → accelerate launch eagle3-train (bf16,
   a checkpoint, a resumed second launch, export) → eagle3-eval reference --device cuda;
   the whole run's training tokens/s beside the step's.
4. vLLM on CUDA, where vllm imports (the image has none: the rows say so).

Prints one table and writes it as JSON (again after each part, so a run cut short keeps
what it measured). ``--budget-s`` skips what would not fit.
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

REPO = Path(__file__).resolve().parents[2]
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


def attention_check(device_name: str = "cuda", tokens: int = 8192) -> dict[str, object]:
    """Flash vs the chunked reference on this GPU, and both paths' fwd+bwd time."""
    sys.path[:0] = [str(p) for p in SOURCES if str(p) not in sys.path]  # run from source
    import torch

    from eagle3_train.attention import chunked_ttt_attention
    from eagle3_train.flash_attention import flash_self_check, flash_ttt_attention

    device = torch.device(device_name)
    row: dict[str, object] = {"problems": flash_self_check(device)}
    T, doc, nh, nkv, d, m = tokens, 2048, 32, 8, 128, 2  # the Llama-3.1-8B draft, TTT step 3
    doc = min(doc, T)
    cu = torch.arange(0, T + 1, doc, device=device)
    doc_start = torch.repeat_interleave(cu[:-1], doc)
    g = torch.Generator(device=device).manual_seed(0)

    def leaf(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()

    q, k0, v0, kd, vd = (
        leaf(nh, T, d),
        leaf(nkv, T, d),
        leaf(nkv, T, d),
        leaf(m, nkv, T, d),
        leaf(m, nkv, T, d),
    )
    paths = {
        "flash": lambda: flash_ttt_attention(q, k0, v0, kd, vd, cu, doc),
        "chunked": lambda: chunked_ttt_attention(q, k0, v0, kd, vd, doc_start),
    }
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name, fn in paths.items():
        for _ in range(2):
            fn().sum().backward()
        sync()
        start = time.perf_counter()
        for _ in range(5):
            fn().sum().backward()
        sync()
        row[f"{name}_fwd_bwd_ms"] = round((time.perf_counter() - start) / 5 * 1e3, 2)
    return row


def train_step(name: str, args: list[str], steps: int) -> dict[str, object]:
    command = [
        sys.executable, str(REPO / "tools" / "bench" / "bench_train.py"), "--device=cuda",
        "--dtype=bfloat16", "--rounds=1", "--warmup=3", f"--steps={steps}", "--skip-loader",
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
        "ours_mfu": round(ours.get("mfu", float("nan")), 3),
        "speculators_mfu": round(theirs.get("mfu", float("nan")), 3),
        "ours_peak_gib": round(ours["peak_gpu_mib"] / 1024, 2),
        "speculators_peak_gib": round(theirs["peak_gpu_mib"] / 1024, 2),
        "ours_peak_kib_per_token": round(ours["peak_gpu_mib"] * 1024 / tokens, 1),
        "memory_vs_speculators": round(ours["peak_gpu_mib"] / theirs["peak_gpu_mib"], 3),
        "host_syncs_in_step": ours.get("host_syncs_in_step"),
        "pageable_copies_in_step": ours.get("pageable_copies_in_step"),
        "top_kernels": ours.get("top_kernels"),
        "seconds": round(time.perf_counter() - start, 1),
    }


def whole_run(out: Path, device: str, samples: int, steps: int) -> dict[str, object]:
    """The tiny recipe's stages on ``device``, as pipeline.sh runs them (corpus answers as
    written: regeneration needs vLLM). Returns each stage's seconds and the training's
    tokens/s over the whole launch (start-up, checkpoints, validation, export included)."""
    target = REPO / "recipes" / "tiny" / "target"
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **_env(),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    row: dict[str, object] = {"device": device, "samples": samples}

    def stage(name: str, *command: object) -> None:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, *map(str, command)], cwd=REPO, env=env,
                              capture_output=True, text=True, check=False)  # fmt: skip
        row[f"{name}_s"] = round(time.perf_counter() - start, 1) + row.get(f"{name}_s", 0.0)
        if done.returncode != 0:
            raise RuntimeError(
                f"{name} failed (exit {done.returncode}):\n{(done.stderr or done.stdout)[-3000:]}"
            )

    corpus = out / "corpus.jsonl"
    stage("corpus", REPO / "tools" / "targets" / "build_tiny_target.py", "--corpus-only", corpus)
    for split in ("train", "heldout"):
        stage("data", "-m", "eagle3_data", "ingest", corpus, "--keep", f"split={split}",
              "--out", out / f"{split}.conversations.parquet")  # fmt: skip
    stage("data", "-m", "eagle3_data", "tokenize", out / "train.conversations.parquet",
          "--tokenizer", target, "--max-length", "512", "--out", out / "train.tokenized.parquet")  # fmt: skip
    stage("data", "-m", "eagle3_data", "vocab", out / "train.tokenized.parquet",
          "--draft-vocab-size", "2048", "--out", out / "vocab_map.safetensors")  # fmt: skip
    stage("extract", "-m", "eagle3_extract", "run", "--model", target, "--tokenized",
          out / "train.tokenized.parquet", "--max-samples", samples, "--device", device,
          "--out", out / "hidden_states")  # fmt: skip
    train = [
        "-m", "accelerate.commands.launch", "--config_file", REPO / "recipes/accelerate/single.yaml",
        "-m", "eagle3_train", "--config", REPO / "recipes/tiny/train.yaml", "--output-dir", out / "train",
        "--set", f"data.hidden_states={out / 'hidden_states'}",
        "--set", f"data.vocab_map={out / 'vocab_map.safetensors'}",
        "--set", f"train.save_every={steps // 2}", "--set", "train.trackers=[]",
    ]  # fmt: skip
    stage("train", *train, "--max-steps", steps // 2)  # a checkpoint, then a resumed launch
    stage("train", *train, "--max-steps", steps)
    records = [
        json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    starts = [r for r in records if r.get("event") == "start"]
    train_logs = [r for r in records if r.get("event") == "train"]
    row["resumed_from_step"] = starts[-1]["step"] if len(starts) == 2 else None
    row["train_steps"] = max(r["step"] for r in train_logs)
    row["train_tokens"] = train_logs[-1]["tokens"]
    row["train_tokens_per_s_whole_launches"] = round(row["train_tokens"] / row["train_s"])
    row["train_tokens_per_s_logged"] = round(
        sum(r["tokens_per_s"] for r in train_logs) / len(train_logs)
    )
    row["final_loss"] = round(train_logs[-1]["loss"], 4)
    stage("eval", "-m", "eagle3_eval", "reference", "--draft", out / "train" / "draft",
          "--target", target, "--prompts", corpus, "--heldout-sources", target / "build_info.json",
          "--limit", "8", "--max-new-tokens", "64", "--device", device, "--out", out / "eval-reference")  # fmt: skip
    report = json.loads((out / "eval-reference" / "report.json").read_text())
    row["acceptance_length_reference"] = round(report["acceptance_length"], 3)
    row["eval_device"] = report.get("engine", {}).get("device")
    return row


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


# (row name, shape, ours' bench_train.py arguments), in the order they run: the two shapes
# as eagle3-train runs on CUDA first, then probes of what compilation and the attention add.
TRAIN_RUNS = [
    ("llama-3.1-8b draft, ours auto+compiled", "llama-3.1-8b draft",
     ["--attention=auto", "--compile=1", "--sync-check=1", "--profile=1"]),
    ("kimi-k2.5 draft, ours auto+compiled", "kimi-k2.5 draft", ["--attention=auto", "--compile=1"]),
    ("llama-3.1-8b draft, ours auto, eager", "llama-3.1-8b draft", ["--attention=auto", "--compile=0"]),
    ("llama-3.1-8b draft, ours chunked (before)", "llama-3.1-8b draft",
     ["--attention=chunked", "--compile=0", "--profile=1"]),
]  # fmt: skip
# rough seconds of each part on an H200 (both sides' processes, compilation), for --budget-s
COST_S = {"attention": 30, "train": 110, "whole": 200, "vllm": 600}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per side")
    parser.add_argument("--parts", nargs="+", default=["attention", "train", "whole", "vllm"])
    parser.add_argument(
        "--device", default="cuda", help="the whole run's device (cpu: a rehearsal here)"
    )
    parser.add_argument("--budget-s", type=float, default=520, help="skip parts that would not fit")
    parser.add_argument("--whole-samples", type=int, default=300)
    parser.add_argument("--whole-steps", type=int, default=60)
    args = parser.parse_args()
    started = time.perf_counter()
    env = environment()
    if args.device.startswith("cuda") and not env["gpu"]:
        print("gpu_check: no CUDA device is visible", file=sys.stderr)
        return 2
    print(json.dumps(env))
    results: dict[str, object] = {"environment": env, "attention": None, "train": [], "whole_run": None, "vllm": []}  # fmt: skip

    def fits(part: str) -> bool:
        left = args.budget_s - (time.perf_counter() - started)
        if COST_S[part] <= left:
            return True
        print(
            f"skipped {part}: ~{COST_S[part]} s needed, {left:.0f} s of the budget left", flush=True
        )
        return False

    def save() -> None:
        args.json.write_text(json.dumps(results, indent=2))

    if "attention" in args.parts and fits("attention"):
        try:
            results["attention"] = attention_check(args.device)
        except Exception as e:  # a check reports and the script goes on to the next part
            results["attention"] = {"problems": [f"{type(e).__name__}: {e}"[:2000]]}
        print("attention:", json.dumps(results["attention"]), flush=True)
        save()
    train_runs = TRAIN_RUNS if "train" in args.parts else []
    for position, (name, shape, ours) in enumerate(train_runs):
        if position == 2 and "whole" in args.parts and fits("whole"):
            results["whole_run"] = _whole_run_row(args)
            save()
        if fits("train"):
            row = train_step(name, [*TRAIN_CONFIGS[shape], *ours], args.steps)
            results["train"].append(row)  # type: ignore[union-attr]
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
            save()
    if "whole" in args.parts and results["whole_run"] is None and fits("whole"):
        results["whole_run"] = _whole_run_row(args)
        save()
    if "vllm" in args.parts:
        results["vllm"] = vllm_tests(args.json.resolve().parent)
    save()
    report(results)
    return 0


def _whole_run_row(args) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            row = whole_run(Path(tmp) / "tiny", args.device, args.whole_samples, args.whole_steps)
        except Exception as e:  # reported, and the script goes on
            row = {"error": f"{type(e).__name__}: {e}"[-3000:]}
    print("whole run:", json.dumps(row), flush=True)
    return row


def report(results: dict[str, object]) -> None:
    env = results["environment"]
    print(
        f"\nGPU check on {env['gpu']} (torch {env['torch']}, speculators {env['speculators']}, vllm {env['vllm']})"
    )  # type: ignore[index]
    attention = results["attention"]
    if attention:
        verdict = (
            "; ".join(attention["problems"])
            or "flash = chunked reference (values, gradients; moved key caught)"
        )  # type: ignore[index]
        flash, chunked = attention.get("flash_fwd_bwd_ms"), attention.get("chunked_fwd_bwd_ms")  # type: ignore[union-attr]
        print(f"attention: {verdict}; fwd+bwd at T 8192: flash {flash} ms, chunked {chunked} ms")
    header = f"{'train step, bf16, T 8192, TTT 3':44}{'ours tok/s':>11}{'spec tok/s':>11}{'speed':>7}{'ours MFU':>9}{'spec MFU':>9}{'ours GiB':>9}{'spec GiB':>9}{'memory':>7}"
    print(header)
    for row in results["train"]:  # type: ignore[union-attr]
        if "error" in row:
            print(f"{row['config']:44} error: {str(row['error']).splitlines()[-1]}")
            continue
        print(
            f"{row['config']:44}{row['ours_tokens_per_s']:>11}{row['speculators_tokens_per_s']:>11}"
            f"{row['speed_vs_speculators']:>7.2f}{row['ours_mfu']:>9.1%}{row['speculators_mfu']:>9.1%}"
            f"{row['ours_peak_gib']:>9.2f}{row['speculators_peak_gib']:>9.2f}{row['memory_vs_speculators']:>7.2f}"
        )
        if row.get("host_syncs_in_step"):
            print(
                f"  host syncs inside one step (sync debug mode 'error'): {row['host_syncs_in_step']}"
            )
        if row.get("pageable_copies_in_step"):
            print(f"  host→device copies from pageable memory: {row['pageable_copies_in_step']}")
        for name, ms, calls in row.get("top_kernels") or []:
            print(f"  {ms:>9.2f} ms {calls:>5}x  {name}")
    whole = results["whole_run"]
    if whole:
        print(f"whole tiny run: {json.dumps(whole)}")
    for row in results["vllm"]:  # type: ignore[union-attr]
        print(f"{row['check']}: {row['outcome']}")


if __name__ == "__main__":
    sys.exit(main())
