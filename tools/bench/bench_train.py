"""Benchmark eagle3-train side by side with speculators 0.9.0, in one run.

1. Training step: our Eagle3Draft vs speculators' Eagle3DraftModel at the same config (one
   packed sequence of T tokens, H, draft vocabulary, TTT steps, AdamW, or ours with the GPU
   recipes' Muon (``--optimizer muon``); lm_head frozen in both, as speculators does).
   speculators runs with sdpa attention and its eager kl_div loss (its defaults need a GPU). Each side runs in its own subprocess, so peak RSS is that
   side's alone; torch threads are set explicitly.
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

    uv run --frozen python tools/bench/bench_train.py                 # H=256 (tiny target), T=2048
    uv run --frozen python tools/bench/bench_train.py --hidden 128 --json out.json
    uv run --frozen python tools/bench/bench_train.py --loader-only --verify-rows   # checksum cost
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

STARTED = time.perf_counter()  # the side's process start, for its phases' seconds
# speculators/train/trainer.py clips every step's gradients at norm 1.0
SPECULATORS_MAX_GRAD_NORM = 1.0


def _batch(args, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    docs = args.tokens // args.doc_len
    lengths = [args.doc_len] * docs
    total = sum(lengths)
    mask = torch.zeros(total, dtype=torch.bool)
    for i in range(docs):
        mask[i * args.doc_len + args.doc_len // 4 : (i + 1) * args.doc_len] = True
    cu = torch.tensor([0, *[args.doc_len * (i + 1) for i in range(docs)]])
    return {
        "aux": torch.randn(total, 3, args.hidden, generator=g),
        "last": torch.randn(total, args.hidden, generator=g),
        "ids": torch.randint(0, args.v_target, (total,), generator=g),
        "mask": mask,
        "cu": cu,
        "lengths": lengths,
    }


def _vocab(args):
    import torch

    g = torch.Generator().manual_seed(1)
    chosen = torch.sort(torch.randperm(args.v_target, generator=g)[: args.v_draft]).values
    t2d = torch.zeros(args.v_target, dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(args.v_draft), t2d


def _heads(args) -> tuple[int, int, int]:
    heads = args.heads or max(1, args.hidden // 64)
    return heads, max(1, heads // 2), args.hidden // heads


def run_ours(args) -> dict[str, float]:
    import torch

    from eagle3_train.model.arch import DraftArch
    from eagle3_train.model.draft import Eagle3Draft

    heads, kv, head_dim = _heads(args)
    arch = DraftArch(
        hidden_size=args.hidden,
        num_aux=3,
        target_vocab_size=args.v_target,
        draft_vocab_size=args.v_draft,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=args.intermediate,
        rms_norm_eps=1e-5,
        target_rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        attention=args.attention,
    )
    from eagle3_train.model.loss import compile_kl_chunk
    from eagle3_train.model.shift import align

    phases = {"imports": time.perf_counter() - STARTED}
    built = time.perf_counter()
    torch.manual_seed(0)
    # built and filled on the device: V_target × H random values per tensor (1.17 G at Kimi's
    # shape) take seconds each from the CPU's generator
    with torch.device(args.device):
        model = Eagle3Draft(arch)
    _, t2d = _vocab(args)
    g = torch.Generator(device=args.device).manual_seed(2)
    head = torch.randn(args.v_target, args.hidden, generator=g, device=args.device)
    embed = torch.randn(args.v_target, args.hidden, generator=g, device=args.device)
    model.load_target_head(embed, torch.ones(args.hidden), head[t2d.to(args.device)])
    del head, embed
    model.lm_head.weight.requires_grad_(False)
    # as eagle3-train sets a run up (eagle3_train.components.build: speed_up, make_optimizer)
    if args.dtype == "bfloat16":
        model.store_frozen_as(torch.bfloat16)
    if args.compile:
        for layer in model.layers:
            layer.compile()
        compile_kl_chunk(True)
    for layer in model.layers:  # train.recompute
        layer.recompute = bool(args.recompute)
    model.to(args.device)
    params = model.trainable_parameters()
    opt = _optimizer(args.optimizer, model, params, fused=args.device == "cuda")
    host = _batch(args)
    b = _on_device(host, args)
    objective, decay, max_grad_norm = _objective(args.objective)
    phases["build"] = time.perf_counter() - built

    def step() -> None:
        # the trainer's step: alignment on the host, moved with the batch; clipping
        al = align(host["ids"], host["mask"], host["cu"], args.ttt_steps).to(args.device)
        with _autocast(args):
            loss, _ = model(
                b["aux"],
                b["last"],
                b["ids"],
                b["mask"],
                b["cu"],
                args.ttt_steps,
                decay,
                alignment=al,
                objective=objective,
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    result = _time(step, args, b["ids"].shape[0], phases)
    if args.sync_check and args.device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            result["host_syncs_in_step"] = "none"
        except RuntimeError as e:
            result["host_syncs_in_step"] = _raised_at(e)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result["pageable_copies_in_step"] = _pageable_copies(step) or "none"
    if args.profile and args.device == "cuda":
        result["top_kernels"] = _top_kernels(step)
    return result


def _raised_at(e: BaseException, frames: int = 5) -> str:
    """Where an error was raised: the traceback's last frames (the op and the line of ours or
    speculators' that called it) and the message's first line — c10's text alone says that
    a step synchronised, not which op did."""
    import traceback

    tail = traceback.extract_tb(e.__traceback__)[-frames:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in reversed(tail))
    return f"{where} :: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _pageable_copies(step) -> list[str]:
    """The host→device copies of one step whose source is pageable memory, each with the line
    that made it: a non-blocking copy from pageable memory is staged through a buffer the host
    waits for, which the sync debug mode does not see. (Compiled code runs eagerly under the
    watch: this step checks the copies, it is not timed.)"""
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
    found: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in copies:
                src = args[1] if func is torch.ops.aten.copy_.default else args[0]
                if src.device.type == "cpu" and out.device.type == "cuda" and not src.is_pinned():
                    stack = traceback.extract_stack()[:-1]  # this frame left out
                    site = next(f for f in reversed(stack) if "/torch/" not in f.filename)
                    found.append(
                        f"{tuple(src.shape)} {src.dtype} at {Path(site.filename).name}:"
                        f"{site.lineno} {site.line}"
                    )
            return out

    with Watch():
        step()
    torch.cuda.synchronize()
    return found


def _top_kernels(step, count: int = 12) -> list[list]:
    """[name, CUDA ms, calls] of the kernels that took most of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        import torch

        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    return [[e.key[:90], round(e.device_time_total / 1e3, 3), e.count] for e in rows[:count]]


def run_speculators(args) -> dict[str, float]:
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.models.eagle3.data import shift_batch
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    heads, kv, head_dim = _heads(args)
    tl = LlamaConfig(
        hidden_size=args.hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=args.intermediate,
        vocab_size=args.v_target,
        rms_norm_eps=1e-5,
        num_hidden_layers=1,
        max_position_embeddings=4096,
    )
    if args.device == "cpu":
        tl._attn_implementation = "sdpa"  # FlexAttention has no CPU backward
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=tl,
        draft_vocab_size=args.v_draft,
        norm_before_residual=False,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.ttt_steps)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),
        ),
    )
    phases = {"imports": time.perf_counter() - STARTED}
    built = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(args.device):  # as ours: built and filled on the device
        model = Eagle3DraftModel(cfg)
    d2t, t2d = _vocab(args)
    model.load_vocab_mappings(t2d.to(args.device), d2t.to(args.device))
    g = torch.Generator(device=args.device).manual_seed(2)
    with torch.no_grad():
        head = torch.randn(args.v_target, args.hidden, generator=g, device=args.device)
        model.embed_tokens.weight.normal_(generator=g)
        rows = head[t2d.to(args.device)]
        model.lm_head.weight.copy_(rows)
        model.verifier_lm_head.weight.copy_(rows)
        del head, rows
    model.to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    b = _batch(args)
    parts, start = [], 0
    for n in b["lengths"]:  # speculators' own per-sample shift, then packing
        s = slice(start, start + n)
        parts.append(
            shift_batch(
                {
                    "input_ids": b["ids"][s],
                    "hidden_states": b["aux"][s].reshape(n, -1),
                    "verifier_last_hidden_states": b["last"][s],
                    "loss_mask": b["mask"][s],
                    "lengths": torch.tensor([n]),
                    "position_ids": torch.arange(n),
                }
            )
        )
        start += n
    cat = {k: torch.cat([p[k] for p in parts])[None] for k in parts[0] if k != "lengths"}
    doc = torch.cat([torch.full((len(p["input_ids"]),), i) for i, p in enumerate(parts)])[None]
    if args.device == "cuda":  # FlexAttention's block mask: pad to whole 128-token blocks, as
        # speculators' collator pads to its fixed length (a padding document, loss_mask 0)
        pad = -cat["input_ids"].shape[1] % 128
        cat = {
            k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) for k, v in cat.items()
        }
        doc = torch.nn.functional.pad(doc, (0, pad), value=len(parts))
    cat, doc = _on_device(cat, args), doc.to(args.device)
    # its eager loss: the fused Triton one needs a GPU and, under torch 2.11's dynamo, fails
    # ("ListVariable ... is already tracked for mutation", speculators/losses/fused.py)
    loss_config = resolve_loss_config("kl_div", "eager")

    def step() -> None:
        with warnings.catch_warnings(), _autocast(args):
            warnings.simplefilter("ignore")
            _, loss, _ = model(
                hidden_states=cat["hidden_states"],
                input_ids=cat["input_ids"],
                document_ids=doc,
                loss_mask=cat["loss_mask"],
                position_ids=cat["position_ids"],
                verifier_last_hidden_states=cat["verifier_last_hidden_states"],
                ttt_steps=args.ttt_steps,
                loss_config=loss_config,
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, SPECULATORS_MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)

    phases["build"] = time.perf_counter() - built
    return _time(step, args, b["ids"].shape[0], phases)


def _on_device(batch: dict, args) -> dict:
    return {k: v.to(args.device) if hasattr(v, "to") else v for k, v in batch.items()}


def _autocast(args):
    """Mixed precision as the trainer runs it (fp32 master weights, autocast compute)."""
    import contextlib

    import torch

    if args.dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(args.device, dtype=getattr(torch, args.dtype))


def _synchronize(args) -> None:
    import torch

    if args.device == "cuda":
        torch.cuda.synchronize()


def _time(step, args, tokens: int, phases: dict[str, float]) -> dict[str, object]:
    """Seconds per step over ``args.steps`` after ``args.warmup`` steps (compilation
    included), and the side's phases in seconds: imports, build, warmup, timed steps."""
    import torch

    base_rss = _rss_mib()  # weights and batch in place, no step yet
    warm = time.perf_counter()
    for _ in range(args.warmup):
        step()
    _synchronize(args)
    phases["warmup"] = time.perf_counter() - warm
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    _synchronize(args)
    seconds = (time.perf_counter() - start) / args.steps
    # CPU seconds of this process per step: on a shared machine less disturbed by other
    # jobs than wall time (with one thread; OpenMP threads may spin-wait)
    cpu_seconds = (time.process_time() - cpu) / args.steps
    phases["timed"] = seconds * args.steps
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "seconds_per_step": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_seconds_per_step": cpu_seconds,
        "peak_rss_mib": peak_rss,
        # on a GPU: the device's peak over the timed steps (weights, optimizer, activations)
        **(
            {"peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20}
            if args.device == "cuda"
            else {}
        ),
        # what a step adds at its peak over the memory held before it (activations, and on
        # CPU the optimizer's state, created by the first step): grows with T
        "step_peak_mib": (torch.cuda.max_memory_allocated() - base_gpu) / 2**20
        if args.device == "cuda"
        else peak_rss - base_rss,
    }


def _rss_mib() -> float:
    """This process's resident memory now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / 2**20


def _failure(output: str, returncode: int) -> str:
    """A side's failure in a few words: "out of memory" where it ran out, else its error's
    last line (a killed process: its signal)."""
    lines = [x for x in output.strip().splitlines() if x.strip()]
    ran_out = ("OutOfMemoryError", "out of memory", "can't allocate memory", "MemoryError")
    if any(any(m in x for m in ran_out) for x in lines[-30:]):
        return "out of memory"
    if returncode < 0:
        return f"killed by signal {-returncode} (the kernel's OOM killer, when 9)"
    return lines[-1][:300] if lines else f"exit {returncode}, no output"


def model_flops_per_token(args) -> float:
    """The module docstring's formula (bench's draft: lm_head frozen, 3 aux layers)."""
    heads, kv, head_dim = _heads(args)
    H, inter, V = args.hidden, args.intermediate, args.v_draft
    layer = 2 * H * (heads + 2 * kv) * head_dim + heads * head_dim * H + 3 * H * inter
    once = 6 * (3 * H) * H + 2 * H * V
    per_step = [
        6 * layer + 12 * heads * head_dim * ((args.doc_len + 1) / 2 + k) + 4 * H * V
        for k in range(args.ttt_steps)
    ]
    return float(once + sum(per_step))


def _device_peak_tflops() -> float | None:
    """Dense bf16 peak by the vendor's datasheet, for the GPUs this project is measured on."""
    import torch

    name = torch.cuda.get_device_name(0)
    return 989.0 if ("H100" in name or "H200" in name) else None


def _optimizer(name: str, model, params, fused: bool):
    """Ours' optimizer. ``adamw``: AdamW on every trained tensor (what speculators' row steps
    with). ``muon``: the GPU recipes' train.optimizer, eagle3-train's own Muon on the hidden
    matrices and AdamW on the rest (components/build.make_muon), as the Llama-3.1-8B recipe's
    train.yaml sets it."""
    import torch

    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, fused=fused)
    from eagle3_train.components.build import make_muon
    from eagle3_train.config.run_config import load_config

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "llama-3.1-8b" / "train.yaml"
    return make_muon(model, load_config(recipe), fused)


def _objective(name: str):
    """(train.objective, ttt_step_loss_decay, max_grad_norm) of ours. ``plain``: what
    speculators trains — plain TTT KL (no top-k term), no step decay, gradients clipped as its
    trainer clips them — so the two sides' rows compare the same work. ``defaults``: eagle3-
    train's own train: defaults (the HASS top-k term, step decay, its clipping)."""
    from eagle3_train.config.train_config import TrainLoopConfig
    from eagle3_train.model.draft import PLAIN_TTT

    if name == "plain":
        return PLAIN_TTT, 1.0, SPECULATORS_MAX_GRAD_NORM
    t = TrainLoopConfig()
    return t.objective, t.ttt_step_loss_decay, t.max_grad_norm


def run_side(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.memory_cap_gib and args.device == "cpu":  # an allocation past it fails in this
        # process (reported "out of memory"), not in a neighbour the kernel's OOM killer picks
        cap = int(args.memory_cap_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    if args.device == "cuda":  # as eagle3-train sets it (train.tf32: true), for both sides
        torch.set_float32_matmul_precision("high")
    result = run_ours(args) if args.side == "ours" else run_speculators(args)
    if args.device == "cuda":
        result["peak_tflops"] = _device_peak_tflops()
    print("BENCH " + json.dumps(result))


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


def _run_sides(args, forwarded: list[str], sides: tuple[str, ...]) -> dict[str, dict]:
    """Each side in its own process. Sides alternate over rounds (load on a shared machine
    hits both alike); the best round of each is kept. A side that fails (out of memory, say)
    has its error as its figure."""
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for side in sides:
            if "error" in results.get(side, {}):
                continue
            proc = subprocess.run(
                [sys.executable, __file__, "--side", side, *forwarded],
                capture_output=True,
                text=True,
                check=False,
            )
            line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
            if line is None:
                results[side] = {"error": _failure(proc.stderr or proc.stdout, proc.returncode)}
                print(f"{side}: {results[side]['error']}", file=sys.stderr)
                continue
            got = json.loads(line[6:])
            best = results.get(side)
            if best is None or got["seconds_per_step"] < best["seconds_per_step"]:
                results[side] = got
    return results


def long_context(args, forwarded: list[str], sides: tuple[str, ...], results: dict) -> int:
    """--lengths: one packed sample of each length (tokens = doc-len = L) per side: the step's
    peak memory over what was held before it, s/step, and ours' growth from one length to
    the next (linear in T: 2.0× per doubling; the chunked attention's scores are a
    fixed-size chunk, not L × (L + k)). The slope between the two longest lengths, per
    token and TTT step, is the activation memory a longer sample adds."""
    rows = []
    for length in args.lengths:
        at = [a for a in forwarded if not a.startswith(("--tokens=", "--doc-len="))]
        at += [f"--tokens={length}", f"--doc-len={length}"]
        got = _run_sides(args, at, sides)
        rows.append({"tokens": length, **got})
        print(f"{length} tokens: " + json.dumps({k: _brief(v) for k, v in got.items()}), flush=True)
    results["long_context"] = rows
    c = args
    print(
        f"\nlong context: one sample of L tokens, H={c.hidden}, heads {_heads(c)[0]}, I={c.intermediate}, "
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
            f"{row['tokens']:>7}{_figure(ours, 'step_peak_mib', '.0f'):>22}{growth:>8}"
            f"{_figure(ours, 'seconds_per_step', '.2f'):>12}{_figure(spec, 'step_peak_mib', '.0f'):>15}"
            f"{_figure(spec, 'seconds_per_step', '.2f'):>12}"
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
    if args.json:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


def _brief(side: dict) -> object:
    return side.get("error") or {
        k: round(side[k], 3) for k in ("step_peak_mib", "seconds_per_step")
    }


def _figure(side: dict, key: str, fmt: str) -> str:
    if "error" in side:
        return "OOM" if side["error"] == "out of memory" else side["error"][:11]
    return format(side[key], fmt) if key in side else "-"


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
    p.add_argument(
        "--verify-rows",
        action="store_true",
        help="loader: also time it with the trainer's row checksum checks (data.verify_rows)",
    )
    p.add_argument("--loader-only", action="store_true", help="only the loader benchmark")
    p.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "chunked", "flash", "sdpa"],
        help="ours: draft.attention",
    )
    p.add_argument("--compile", type=int, default=0, help="ours: compiled layers and loss (1)")
    p.add_argument(
        "--recompute", type=int, default=0, help="ours: train.recompute, layers recomputed (1)"
    )
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
    p.add_argument(
        "--sides", default="both", choices=["both", "ours", "speculators"], help="which to run"
    )
    p.add_argument("--sync-check", type=int, default=0, help="ours, CUDA: a step under sync debug")
    p.add_argument("--profile", type=int, default=0, help="ours, CUDA: top kernels of a step")
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
    p.add_argument(
        "--memory-cap-gib", type=float, help="CPU: address-space cap of each side's process"
    )
    args = p.parse_args()
    if args.side:
        run_side(args)
        return 0
    forwarded = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k
        not in ("side", "json", "rounds", "skip_loader", "verify_rows", "loader_only", "lengths")
        and v is not None
    ]
    results: dict[str, object] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("side", "json")}
    }
    if args.loader_only:
        loaders(args, results, {})
        if args.json:
            args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
        return 0
    sides = ("speculators", "ours") if args.sides == "both" else (args.sides,)
    if args.lengths:
        return long_context(args, forwarded, sides, results)
    results.update(_run_sides(args, forwarded, sides))
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
        f"ours: attention {c.attention}, compile {c.compile}, objective {c.objective}"
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
    flops = model_flops_per_token(args)
    results["model_flops_per_token"] = flops
    peak = next((r.get("peak_tflops") for r in ran.values()), None)
    print(f"model FLOPs per trained token: {flops / 1e9:.2f} GFLOP")
    if peak:
        for side in ran:
            mfu = results[side]["tokens_per_s"] * flops / (peak * 1e12)
            results[side]["mfu"] = mfu
            print(f"{side} MFU: {mfu:.1%} of {peak:.0f} TFLOP/s")
    results["ratios"] = ratios
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
