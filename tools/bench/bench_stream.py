"""Benchmark of the streaming hand-off (issue 12): producer and trainer together on the tiny target.

    uv run tools/bench/bench_stream.py [--samples 400] [--window-shards 2] [--budget-windows 3]
    EAGLE3_VLLM_PYTHON=... uv run tools/bench/bench_stream.py --backend vllm

Builds the tiny recipe's tokenized corpus, then runs ``eagle3-extract run --stream
--disk-budget B`` and ``accelerate launch eagle3-train --reclaim`` (data.order shard_window)
at the same time, the budget being ``--budget-windows`` windows of shards (window 0 is kept
for validation, one is in training, the rest lets the producer run ahead). Then the same
extraction and training one after the other, offline, for the comparison. Prints, as JSON:

- producer and trainer tokens/s, each over its own wall time;
- the producer's paused fraction (waiting for reclaimed room) and the trainer's idle
  fraction (waiting for sealed shards): the side that waits is the faster one;
- peak bytes of shards on disk (sampled every 10 ms) against the budget and the dataset;
- streamed wall time against offline extract + train (the overlap's gain).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from eagle3_schemas.stream import partial_dir, shard_bytes_on_disk

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "recipes" / "tiny" / "target"
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def _run(command: list[str], env: dict[str, str] | None = None) -> str:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def tiny_inputs(root: Path) -> tuple[Path, Path]:
    """The tiny recipe's training corpus, tokenized by the tiny target, and its vocab map
    (tests/test_stream.py uses the same inputs)."""
    corpus, conversations = root / "corpus.jsonl", root / "conversations.parquet"
    tokenized, vocab = root / "tokenized.parquet", root / "vocab_map.safetensors"
    data = [sys.executable, "-m", "eagle3_data"]
    _run([sys.executable, "tools/targets/build_tiny_target.py", "--corpus-only", str(corpus)])
    _run([*data, "ingest", str(corpus), "--keep", "split=train", "--out", str(conversations)])
    _run(
        [
            *data,
            "tokenize",
            str(conversations),
            "--tokenizer",
            str(TARGET),
            "--max-length",
            "512",
            "--out",
            str(tokenized),
        ]
    )
    _run([*data, "vocab", str(tokenized), "--draft-vocab-size", "512", "--out", str(vocab)])
    return tokenized, vocab


def _producer_command(args: argparse.Namespace, tokenized: Path, out: Path) -> tuple[list, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.producer_threads)}
    python, backend = sys.executable, []
    if args.backend == "vllm":
        python = os.environ["EAGLE3_VLLM_PYTHON"]
        sources = [REPO / "packages" / p / "src" for p in ("eagle3-extract", "eagle3-schemas")]
        env["PYTHONPATH"] = os.pathsep.join(map(str, sources))
        backend = ["--backend", "vllm", "--gpu-memory-utilization", "0.1", "--enforce-eager"]
        backend += ["--max-model-len", "1024", "--shards-per-call", "1"]
    command = [python, "-m", "eagle3_extract", "run", "--model", str(TARGET)]
    command += ["--tokenized", str(tokenized), "--out", str(out), *backend]
    command += ["--max-samples", str(args.samples), "--sample-seed", "0"]
    command += ["--shard-mb", str(args.shard_mb)]
    return command, env


def _train_config(args: argparse.Namespace, run: Path, data: Path, vocab: Path, stream: bool):
    config = {
        "output_dir": str(run),
        "target": {"path": str(TARGET)},
        "data": {
            "hidden_states": str(data),
            "vocab_map": str(vocab),
            "validation_fraction": 0.05,
            "max_tokens_per_batch": 2048,
            "num_workers": 1,
            "order": "shard_window",
            "window_shards": args.window_shards,
            "stream": stream,
        },
        "train": {
            "epochs": 1,
            "lr": 1e-3,
            "warmup_steps": 5,
            "log_every": 5,
            "save_every": 1000,
            "trackers": [],
            "torch_threads": args.trainer_threads,
            "progress_bar": False,
        },
        "export": {"dtype": "float32"},
    }
    path = run.parent / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    command = [ACCELERATE, "launch", "--config_file", "recipes/accelerate/single.yaml"]
    command += ["-m", "eagle3_train", "--config", str(path), "--no-preflight"]
    return command + (["--reclaim"] if stream else [])


def _trained_tokens(run: Path) -> int:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return max(r.get("tokens", 0) for r in records if r.get("event") == "train")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=400)
    p.add_argument("--shard-mb", type=float, default=4.0)
    p.add_argument("--window-shards", type=int, default=2)
    p.add_argument("--budget-windows", type=float, default=3.0)
    p.add_argument("--backend", choices=("hf", "vllm"), default="hf")
    p.add_argument("--producer-threads", type=int, default=1)
    p.add_argument("--trainer-threads", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    tokenized, vocab = tiny_inputs(root)

    # Offline first: its shard sizes set the budget, its times are the comparison.
    offline = root / "offline"
    command, env = _producer_command(args, tokenized, offline)
    began = time.perf_counter()
    summary = json.loads(_run(command, env).strip().splitlines()[-1])
    extract_s = time.perf_counter() - began
    sizes = sorted((p.name, p.stat().st_size) for p in (offline / "shards").iterdir())
    windows = [
        sum(s for _, s in sizes[i : i + args.window_shards])
        for i in range(0, len(sizes), args.window_shards)
    ]
    budget = int(args.budget_windows * max(windows))
    began = time.perf_counter()
    _run(_train_config(args, root / "offline-run", offline, vocab, stream=False))
    train_s = time.perf_counter() - began

    streamed = root / "stream"
    command, env = _producer_command(args, tokenized, streamed)
    command += ["--stream", "--disk-budget", str(budget)]
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], shard_bytes_on_disk(partial_dir(streamed)))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    began = time.perf_counter()
    producer = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    run = root / "stream-run"
    trainer = subprocess.run(
        _train_config(args, run, streamed, vocab, stream=True),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    trainer_s = time.perf_counter() - began
    out, _ = producer.communicate()
    wall_s = time.perf_counter() - began
    stop.set()
    watcher.join()
    if producer.returncode or trainer.returncode:
        raise SystemExit(f"streamed run failed:\n{trainer.stderr[-4000:]}")
    produced = json.loads(out.strip().splitlines()[-1])
    done = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    tokens = summary["tokens"]
    print(
        json.dumps(
            {
                "backend": args.backend,
                "samples": args.samples,
                "tokens": tokens,
                "shards": len(sizes),
                "dataset_bytes": sum(s for _, s in sizes),
                "budget_bytes": budget,
                "peak_shard_bytes": peak[0],
                "peak_over_budget": round(peak[0] / budget, 3),
                "peak_over_dataset": round(peak[0] / sum(s for _, s in sizes), 3),
                "producer_tokens_per_s": round(tokens / produced["seconds"], 1),
                "producer_paused_fraction": round(
                    produced["paused_seconds"] / produced["seconds"], 3
                ),
                "trainer_tokens_per_s": round(_trained_tokens(run) / done["seconds"], 1),
                "trainer_idle_fraction": done["stream_idle_fraction"],
                "offline_extract_s": round(extract_s, 1),
                "offline_train_s": round(train_s, 1),
                "streamed_wall_s": round(wall_s, 1),
                "streamed_trainer_s": round(trainer_s, 1),
                "streamed_over_sequential": round(wall_s / (extract_s + train_s), 3),
                "work_dir": str(root),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
