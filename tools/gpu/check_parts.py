"""The GPU check's parts that are not training rows, each computed in gpu_check.py's child
process (``--run-part``): the flash attention against the chunked reference, the whole tiny
run, and vLLM's tests on CUDA. Standard library only at import: ``gpu_check.py --plan``
imports this and runs nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = [REPO / "packages" / p / "src" for p in ("eagle3-schemas", "eagle3-train", "eagle3-extract", "eagle3-eval", "eagle3-data")]  # fmt: skip

VLLM_TESTS = {
    "vLLM extraction = transformers (tiny Llama)": "packages/eagle3-extract/tests/test_vllm_backend.py",
    "vLLM extraction = transformers (Kimi stand-in, MLA+MoE)": "tests/test_kimi_recipe.py::test_vllm_extraction_of_the_wrapper_matches_transformers",
    "vLLM serves the MLA draft beside the Kimi stand-in": "tests/test_kimi_recipe.py::test_vllm_serves_the_mla_draft_and_agrees_with_the_reference",
    "vLLM acceptance length of the tiny draft": "packages/eagle3-eval/tests/test_vllm.py",
}  # fmt: skip


def source_env() -> dict[str, str]:
    """This environment with the packages' sources first on PYTHONPATH (run from the tree)."""
    path = [str(p) for p in SOURCES] + [os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}


def attention_check(device_name: str, tokens: int) -> dict[str, object]:
    """Flash vs the chunked reference on this device, and both paths' fwd+bwd time."""
    sys.path[:0] = [str(p) for p in SOURCES if str(p) not in sys.path]  # run from source
    import torch

    from eagle3_train.model.attention import chunked_ttt_attention
    from eagle3_train.model.flash_attention import flash_self_check, flash_ttt_attention

    device = torch.device(device_name)
    row: dict[str, object] = {"problems": flash_self_check(device), "tokens": tokens}
    T, doc, nh, nkv, d, m = tokens, 2048, 32, 8, 128, 2  # the Llama-3.1-8B draft, TTT step 3
    doc = min(doc, T)
    cu = torch.arange(0, T + 1, doc, device=device)
    doc_start = torch.repeat_interleave(cu[:-1], doc)
    g = torch.Generator(device=device).manual_seed(0)

    def leaf(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16).requires_grad_()

    q = leaf(nh, T, d)
    k0, v0 = leaf(nkv, T, d), leaf(nkv, T, d)
    kd, vd = leaf(m, nkv, T, d), leaf(m, nkv, T, d)
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


def whole_run(
    out: Path, device: str, samples: int, steps: int, deadline: float
) -> dict[str, object]:
    """The tiny recipe's stages on ``device``, as pipeline.sh runs them (corpus answers as
    written: regeneration needs vLLM), training not compiled. Returns each stage's seconds
    and the training's tokens/s over the whole launch (start-up, checkpoints, validation,
    export included)."""
    target = REPO / "recipes" / "tiny" / "target"
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **source_env(),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    row: dict[str, object] = {"device": device, "samples": samples}

    def stage(name: str, *command: object) -> None:
        start = time.perf_counter()
        try:
            done = subprocess.run(
                [sys.executable, *map(str, command)], cwd=REPO, env=env, capture_output=True,
                text=True, check=False, timeout=max(1.0, deadline - time.time()),
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{name} timed out at the end of the budget") from None
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
        "--set", "train.compile=never",
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
    # The target's own list of held-out files is the proof (--split none): on a Python whose
    # stdlib differs from the target's build, the corpus has files the target never saw whose
    # rows split heldout, and the split field alone would then disagree with that list.
    stage("eval", "-m", "eagle3_eval", "reference", "--draft", out / "train" / "draft",
          "--target", target, "--prompts", corpus, "--split", "none",
          "--heldout-sources", target / "build_info.json",
          "--limit", "8", "--max-new-tokens", "64", "--device", device, "--out", out / "eval-reference")  # fmt: skip
    report = json.loads((out / "eval-reference" / "report.json").read_text())
    row["acceptance_length_reference"] = round(report["acceptance_length"], 3)
    row["eval_device"] = report.get("engine", {}).get("device")
    return row


def vllm_tests(out_dir: Path, deadline: float) -> dict[str, object]:
    rows = []
    env = {**source_env(), "EAGLE3_VLLM_PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    for name, selection in VLLM_TESTS.items():
        report = out_dir / "junit.xml"
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "vllm", "-p", "no:cacheprovider",
             f"--junitxml={report}", selection],
            cwd=REPO, env=env, capture_output=True, text=True, check=False,
            timeout=max(1.0, deadline - time.time()),
        )  # fmt: skip
        outcomes = []
        for case in ET.parse(report).iter("testcase"):
            kinds = [child.tag for child in case]
            outcome = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
            detail = next((c.get("message", "") for c in case if c.tag == outcome), "")
            outcomes.append(f"{case.get('name')}: {outcome} {detail[:200]}".strip())
        seconds = round(time.perf_counter() - start, 1)
        rows.append({"check": name, "outcome": "; ".join(outcomes), "seconds": seconds})
    return {"checks": rows}
