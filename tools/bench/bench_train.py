"""Benchmark eagle3-train side by side with speculators 0.9.0, in one run.

1. Training step: our Eagle3Draft vs speculators' Eagle3DraftModel at the same config (one
   packed sequence of T tokens, H, draft vocabulary, TTT steps, AdamW, or Muon on the same
   matrices (``--optimizer muon``: ours as the GPU recipes set it, speculators at its 0.9.0
   defaults); lm_head frozen in both, as speculators does, or in
   ours trained as the recipes train it (``--head trained``); ``--scored``, the share of each
   document the loss scores (its answer), 0.75 by default, 1 for every token).
   speculators runs with sdpa attention and its eager kl_div loss (its defaults need a GPU).
   Each side runs in its own subprocess (train_step_sides.py), so peak RSS is that side's
   alone; torch threads are set explicitly.
2. Loader: eagle3-train's shard streaming vs the raw read throughput of the same shard bytes
   (sequential 8 MiB reads of the whole files, page cache warm for both, interleaved
   repeats, best of each), with 0 and 2 workers in steady state. ``--verify-rows``: also
   with the trainer's row checks (data.verify_rows: each sample's rows hashed as read and
   compared with the manifest's XXH3-128); ``--loader-only`` skips the training step.
3. Model FLOPs per trained token from the shape, and on a GPU each side's share of the
   device's dense bf16 peak (MFU). Per token, with T_doc the packed documents' length:

       fc (once):             6·(n_aux·H)·H
       target head (once):    2·H·V_draft
       per TTT step k:        6·P_layer + 12·n_heads·head_dim·((T_doc+1)/2 + k)
                              + (6 if the draft head trains else 4)·H·V_draft
       P_layer = 2H·(n_heads + 2·n_kv)·head_dim + n_heads·head_dim·H + 3·H·I

   (a matmul's backward costs twice its forward; attention counts the causal keys' average
   plus the diagonal keys). The same formula for both sides: MFU compares tokens/s.
4. ``--lengths``: one packed sample of each length, each side's step peak memory and s/step
   (recipes/kimi-k2.5/RESOURCES.md "Long samples"; ``--recompute 1``: with train.recompute).
5. On CUDA, for tools/gpu/gpu_check.py: ``--sync-check``, one more step of ours under
   torch.cuda.set_sync_debug_mode("error") (an op that waits for the GPU raises and is
   named) and its host→device copies from pageable memory; ``--profile``, the top kernels.
   ``--profile`` on either device: one profiled step of ours timed by part (attention, GEMMs,
   loss, optimizer, copies).

    uv run --frozen python tools/bench/bench_train.py                 # H=256 (tiny target), T=2048
    uv run --frozen python tools/bench/bench_train.py --hidden 128 --json out.json
    uv run --frozen python tools/bench/bench_train.py --loader-only --verify-rows   # checksum cost
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's modules beside it
from train_step_sides import heads_of, run_side


def run_sides(args, forwarded: list[str], sides: tuple[str, ...]) -> dict[str, dict]:
    """Each side in its own process. Sides alternate over rounds (load on a shared machine
    hits both alike); the best round of each is kept. A side that fails (out of memory, say)
    has its error as its figure."""
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for side in sides:
            if "error" in results.get(side, {}):
                continue
            command = [sys.executable, __file__, "--side", side, *forwarded]
            proc = subprocess.run(command, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
            if line is None:
                results[side] = {"error": failure(proc.stderr or proc.stdout, proc.returncode)}
                print(f"{side}: {results[side]['error']}", file=sys.stderr)
                continue
            got = json.loads(line[6:])
            if side not in results or got["seconds_per_step"] < results[side]["seconds_per_step"]:
                results[side] = got
    return results


def failure(output: str, returncode: int) -> str:
    """A side's failure in a few words: "out of memory" where it ran out, else its error's
    last line (a killed process: its signal)."""
    lines = [x for x in output.strip().splitlines() if x.strip()]
    ran_out = ("OutOfMemoryError", "out of memory", "can't allocate memory", "MemoryError")
    if any(m in x for x in lines[-30:] for m in ran_out):
        return "out of memory"
    if returncode < 0:
        return f"killed by signal {-returncode} (the kernel's OOM killer, when 9)"
    return lines[-1][:300] if lines else f"exit {returncode}, no output"


def figure(side: dict, key: str, fmt: str) -> str:
    if "error" in side:
        return "OOM" if side["error"] == "out of memory" else side["error"][:11]
    return format(side[key], fmt) if key in side else "-"


def long_context(args, forwarded: list[str], sides: tuple[str, ...], results: dict) -> None:
    """--lengths: one packed sample of each length (tokens = doc-len = L) per side: the step's
    peak memory over what was held before it, s/step, and ours' growth from one length to
    the next (linear in T: 2.0× per doubling; the chunked attention's scores are a
    fixed-size chunk, not L × (L + k)). The slope between the two longest lengths, per
    token and TTT step, is the activation memory a longer sample adds."""
    rows = []
    for length in args.lengths:
        at = [a for a in forwarded if not a.startswith(("--tokens=", "--doc-len="))]
        got = run_sides(args, [*at, f"--tokens={length}", f"--doc-len={length}"], sides)
        rows.append({"tokens": length, **got})
        brief = {
            side: r.get("error")
            or {k: round(r[k], 3) for k in ("step_peak_mib", "seconds_per_step")}
            for side, r in got.items()
        }
        print(f"{length} tokens: " + json.dumps(brief), flush=True)
    results["long_context"] = rows
    c = args
    print(
        f"\nlong context: one sample of L tokens, H={c.hidden}, heads {heads_of(c)[0]}, I={c.intermediate}, "
        f"V_target={c.v_target}, V_draft={c.v_draft}, TTT={c.ttt_steps}, {c.device} {c.dtype}, "
        f"ours: attention {c.attention}, objective {c.objective}, recompute {c.recompute}"
    )
    unit = "GPU" if c.device == "cuda" else "RSS"
    print(f"{'L':>7}{'ours step MiB (' + unit + ')':>22}{'x prev':>8}{'ours s/step':>12}{'spec step MiB':>15}{'spec s/step':>12}")  # fmt: skip
    previous = None
    for row in rows:
        ours, spec = row.get("ours", {}), row.get("speculators", {})
        mem = ours.get("step_peak_mib")
        growth = f"{mem / previous:.2f}" if mem and previous else "-"
        previous = mem
        print(
            f"{row['tokens']:>7}{figure(ours, 'step_peak_mib', '.0f'):>22}{growth:>8}"
            f"{figure(ours, 'seconds_per_step', '.2f'):>12}{figure(spec, 'step_peak_mib', '.0f'):>15}"
            f"{figure(spec, 'seconds_per_step', '.2f'):>12}"
        )
    fitted = [r for r in rows if "step_peak_mib" in r.get("ours", {})]
    if len(fitted) >= 2:
        (a, b) = fitted[-2:]
        slope = (b["ours"]["step_peak_mib"] - a["ours"]["step_peak_mib"]) * 2**20 / (b["tokens"] - a["tokens"])  # fmt: skip
        results["ours_activation_bytes_per_token"] = slope
        results["ours_activation_bytes_per_token_per_ttt_step"] = slope / c.ttt_steps
        print(
            f"ours: {slope:.0f} bytes per token ({slope / c.ttt_steps:.0f} per token per TTT "
            f"step, = {slope / c.ttt_steps / c.hidden:.1f} x H), from L {a['tokens']} to {b['tokens']}"
        )


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
            "shard_mib": sum(p.stat().st_size for p in ds.shard_paths) / 2**20,
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


def model_flops_per_token(args, head_trained: bool = False) -> float:
    """The module docstring's formula (3 aux layers; the draft's lm_head frozen, or trained)."""
    heads, kv, head_dim = heads_of(args)
    H, inter, V = args.hidden, args.intermediate, args.v_draft
    layer = 2 * H * (heads + 2 * kv) * head_dim + heads * head_dim * H + 3 * H * inter
    attention = [
        12 * heads * head_dim * ((args.doc_len + 1) / 2 + k) for k in range(args.ttt_steps)
    ]
    head = (6 if head_trained else 4) * H * V
    return float(6 * (3 * H) * H + 2 * H * V + sum(6 * layer + a + head for a in attention))


def training_step(args, forwarded: list[str], sides: tuple[str, ...], results: dict) -> None:
    """Both sides' step, their ratios, the loader rows (unless --skip-loader) and the MFU."""
    results.update(run_sides(args, forwarded, sides))
    ran = {side: results[side] for side in sides if "error" not in results[side]}
    ratios: dict[str, float] = {}
    if len(ran) == 2:
        ours, theirs = ran["ours"], ran["speculators"]
        ratios["train_tokens_per_s_vs_speculators"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
        ratios["train_cpu_time_speedup_vs_speculators"] = (
            theirs["cpu_seconds_per_step"] / ours["cpu_seconds_per_step"]
        )
        ratios["peak_rss_vs_speculators"] = ours["peak_rss_mib"] / theirs["peak_rss_mib"]
        if args.device == "cuda":
            ratios["peak_gpu_memory_vs_speculators"] = ours["peak_gpu_mib"] / theirs["peak_gpu_mib"]
    c = args
    print(
        f"config: T={c.tokens} (docs of {c.doc_len}), H={c.hidden}, I={c.intermediate}, V_target={c.v_target}, "
        f"V_draft={c.v_draft}, TTT={c.ttt_steps}, ours {c.optimizer}, {c.device} {c.dtype}, threads={c.threads}, "
        f"ours: attention {c.attention}, compile {c.compile}, objective {c.objective}, "
        f"head {c.head}, scored {c.scored}"
    )
    memory = "peak GPU MiB" if args.device == "cuda" else "peak RSS MiB"
    print(f"{'':14}{'s/step':>10}{'tokens/s':>12}{'CPU s/step':>12}{memory:>14}")
    for side in sides:
        r = results[side]
        if "error" in r:
            print(f"{side:14}{r['error']}")
            continue
        peak = r["peak_gpu_mib"] if args.device == "cuda" else r["peak_rss_mib"]
        print(
            f"{side:14}{r['seconds_per_step']:>10.3f}{r['tokens_per_s']:>12.0f}"
            f"{r['cpu_seconds_per_step']:>12.3f}{peak:>14.0f}"
        )
    if not args.skip_loader:
        loaders(args, results, ratios)
    flops = results["model_flops_per_token"] = model_flops_per_token(args)
    side_flops = {"speculators": flops, "ours": model_flops_per_token(args, args.head == "trained")}
    peak = next((r.get("peak_tflops") for r in ran.values()), None)
    print(f"model FLOPs per trained token: {flops / 1e9:.2f} GFLOP (lm_head frozen)")
    if peak:
        for side in ran:
            mfu = results[side]["mfu"] = (
                results[side]["tokens_per_s"] * side_flops[side] / (peak * 1e12)
            )
            print(f"{side} MFU: {mfu:.1%} of {peak:.0f} TFLOP/s")
    results["ratios"] = ratios
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--side", choices=["ours", "speculators"], help=argparse.SUPPRESS)
    p.add_argument("--tokens", type=int, default=2048, help="packed tokens per step")
    p.add_argument("--doc-len", type=int, default=512, help="tokens per packed document")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=576)
    p.add_argument("--v-target", type=int, default=4096)
    p.add_argument("--v-draft", type=int, default=1024)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--heads", type=int, help="attention heads (default: hidden // 64)")
    p.add_argument("--skip-loader", action="store_true")
    p.add_argument("--verify-rows", action="store_true", help="loader: also with the row checks")
    p.add_argument("--loader-only", action="store_true", help="only the loader benchmark")
    p.add_argument("--attention", default="auto", choices=["auto", "chunked", "flash", "sdpa"])
    p.add_argument("--compile", type=int, default=0, help="ours: compiled layers and loss (1)")
    p.add_argument("--recompute", type=int, default=0, help="ours: train.recompute (1)")
    p.add_argument(
        "--objective",
        default="plain",
        choices=["plain", "defaults"],
        help="ours: plain = speculators' objective (plain TTT KL, no step decay, its clipping "
        "at 1.0); defaults = eagle3-train's train: defaults (top-k term, decay, clipping)",
    )
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "muon"],
        help="ours: adamw on every tensor, or muon as the GPU recipes train (AdamW on the rest)",
    )
    p.add_argument("--sides", default="both", choices=["both", "ours", "speculators"])
    p.add_argument("--sync-check", type=int, default=0, help="ours, CUDA: a step under sync debug")
    p.add_argument("--profile", type=int, default=0, help="ours: a step's time by part")
    p.add_argument(
        "--head", default="frozen", choices=["frozen", "trained"], help="ours' draft LM head"
    )
    p.add_argument("--scored", type=float, default=0.75, help="share of each document scored")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--loader-samples", type=int, default=128)
    p.add_argument("--repeats", type=int, default=9, help="loader timing repeats (min taken)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two sides")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--lengths",
        type=lambda x: [int(n) for n in x.split(",")],
        help="long-context table: one sample of each length, e.g. 4096,16384,32768,65536",
    )
    p.add_argument("--memory-cap-gib", type=float, help="CPU: each side's address-space cap")
    args = p.parse_args()
    if args.side:
        run_side(args)
        return 0
    local = ("side", "json", "rounds", "skip_loader", "verify_rows", "loader_only", "lengths")
    forwarded = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in local and v is not None
    ]
    results: dict = {"config": {k: v for k, v in vars(args).items() if k not in ("side", "json")}}
    sides = ("speculators", "ours") if args.sides == "both" else (args.sides,)
    if args.loader_only:
        loaders(args, results, {})
    elif args.lengths:
        long_context(args, forwarded, sides, results)
    else:
        training_step(args, forwarded, sides, results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
