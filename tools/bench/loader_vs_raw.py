"""bench_train.py's loader rows: eagle3-train's shard streaming vs the raw read throughput of
the same shard bytes (sequential 8 MiB reads of the whole files, page cache warm for both,
interleaved repeats, best of each), with 0 and 2 workers in steady state, and with
``--verify-rows`` the trainer's row checks (data.verify_rows).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path


def bench_loader(args, hidden: int, samples: int) -> dict[str, float]:
    import numpy as np
    import torch

    from eagle3_train.data.dataset import HiddenStateDataset, plan_epoch
    from eagle3_train.data.loader import make_loader

    # The trainer's synthetic hidden states are shared with the tests (tests/support).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from support.synthetic_states import write_dataset

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = write_dataset(
            Path(tmp) / "hs",
            num_samples=samples,
            min_len=256,
            max_len=1024,
            samples_per_shard=64,
            hidden=hidden,
            v_target=args.v_target,
            storage_dtype="bfloat16",
            num_layers=6,
            aux_layer_ids=(2, 3, 5),
        )
        ds = HiddenStateDataset(root)
        tokens = int(ds.num_tokens.sum())
        shard_bytes = sum(p.stat().st_size for p in ds.shard_paths)
        plan = plan_epoch(ds.num_tokens, np.arange(len(ds)), args.tokens, seed=0, epoch=0)
        batch_bytes = max(sum(n for _, n in b) for b in plan) * ds.bytes_per_token()
        # The raw side reads the same files sequentially into memory as large as the
        # loader's: two batch-sized buffers in turn, as the loader's ring of two slots (a
        # small reused buffer would stay in the CPU cache and measure the cache, not memory).
        rings = [memoryview(bytearray(batch_bytes)) for _ in range(2)]

        def raw_read() -> float:
            start, turn = time.perf_counter(), 0
            for path in ds.shard_paths:
                with open(path, "rb", buffering=0) as f:
                    offset = 0
                    while True:
                        if offset + (8 << 20) > batch_bytes:
                            turn, offset = turn + 1, 0
                        got = f.readinto(rings[turn % 2][offset : offset + (8 << 20)])
                        if not got:
                            break
                        offset += got
            return time.perf_counter() - start

        def load(workers: int, verify: str | None = None) -> float:
            """Seconds per epoch in steady state: the plan twice over, the second pass
            timed (the ring's buffers are faulted in and the workers started by then, as
            they are a few batches into a real epoch of thousands)."""
            seen, start = 0, 0.0
            # as the trainer reads
            stream = make_loader(ds, plan * 2, workers, recycle=True, verify=verify)
            for i, batch in enumerate(stream):
                if i == len(plan):
                    start = time.perf_counter()
                if i >= len(plan):
                    seen += int(batch["input_ids"].shape[0])
                batch["lease"].release()  # done with its rows (the trainer's to_device)
            assert seen == tokens
            return time.perf_counter() - start

        raw_read()  # warm the page cache for both sides
        load(0)
        raw_s, w0_s, w2_s, w0v_s, w2v_s = [], [], [], [], []
        for _ in range(args.repeats):  # interleaved, so load changes hit both sides alike
            raw_s.append(raw_read())
            w0_s.append(load(0))
            if args.verify_rows:
                w0v_s.append(load(0, "stop"))
        for _ in range(max(2, args.repeats // 3)):
            w2_s.append(load(2))
            if args.verify_rows:
                w2v_s.append(load(2, "stop"))
        out = {
            "hidden": hidden,
            "tokens": tokens,
            "shard_mib": shard_bytes / 2**20,
            "raw_tokens_per_s": tokens / min(raw_s),
            "loader_tokens_per_s_w0": tokens / min(w0_s),
            "loader_tokens_per_s_w2": tokens / min(w2_s),
        }
        if args.verify_rows:
            out["loader_verified_tokens_per_s_w0"] = tokens / min(w0v_s)
            out["loader_verified_tokens_per_s_w2"] = tokens / min(w2v_s)
        return out


def loaders(args, results: dict[str, object], ratios: dict[str, float]) -> None:
    """The loader vs a raw read at the train config's H and at Kimi-K2.5's (57 KiB per token),
    about 1 GiB each, with 0 and 2 workers; with --verify-rows also the row checks' cost."""
    shapes = {"loader": (args.hidden, args.loader_samples), "loader_kimi": (7168, 32)}
    for key, (hidden, samples) in shapes.items():
        loader = results[key] = bench_loader(args, hidden, samples)
        line = (
            f"{key}: H={hidden}, {loader['tokens']} tokens in {loader['shard_mib']:.0f} MiB of "
            f"bf16 shards; raw read {loader['raw_tokens_per_s']:.0f} tok/s"
        )
        for w in ("w0", "w2"):
            plain = loader[f"loader_tokens_per_s_{w}"]
            ratios[f"{key}_vs_raw_read_{w}"] = plain / loader["raw_tokens_per_s"]
            line += f"; {w}: {plain:.0f} tok/s"
            checked = loader.get(f"loader_verified_tokens_per_s_{w}")
            if checked is not None:
                line += f", checked {checked:.0f} tok/s ({checked / plain:.2f}x)"
        print(line)
