"""One side of bench_train.py's training step, run in its own process (``--side``): ours'
Eagle3Draft or speculators' Eagle3DraftModel at the same config, on the same synthetic packed
batch, timed over the asked steps, with its phases and peak memory. Prints one line
``BENCH {json}`` for the parent. And the probes of ours' step: the op that makes the host wait
(under ``torch.cuda.set_sync_debug_mode("error")``), the host→device copies from pageable
memory, the kernels that took most of the step (tools/gpu/gpu_check.py's llama row), and (on
either device) the step's time by part.
"""

from __future__ import annotations

import json
import resource
import time
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

from speculators_loop import SPECULATORS_CLIP, pack_documents, speculators_config

STARTED = time.perf_counter()  # the side's process start, for its phases' seconds


def _batch(args, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    total = args.tokens // args.doc_len * args.doc_len
    prompt = round(args.doc_len * (1 - args.scored))  # the rest of each document is scored
    return {
        "aux_hidden_states": torch.randn(total, 3, args.hidden, generator=g),
        "last_hidden_state": torch.randn(total, args.hidden, generator=g),
        "input_ids": torch.randint(0, args.v_target, (total,), generator=g),
        "loss_mask": torch.arange(total) % args.doc_len >= prompt,
        "cu_seqlens": torch.arange(0, total + 1, args.doc_len),
    }


def _vocab(args):
    import torch

    g = torch.Generator().manual_seed(1)
    chosen = torch.sort(torch.randperm(args.v_target, generator=g)[: args.v_draft]).values
    t2d = torch.zeros(args.v_target, dtype=torch.bool).index_fill_(0, chosen, True)
    return chosen - torch.arange(args.v_draft), t2d


def heads_of(args) -> tuple[int, int, int]:
    heads = args.heads or max(1, args.hidden // 64)
    return heads, max(1, heads // 2), args.hidden // heads


def ours_arch(args):
    """Ours' draft at the bench's shape: one Llama-style layer."""
    from eagle3_train.model.arch import DraftArch

    heads, kv, head_dim = heads_of(args)
    return DraftArch(
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


def run_ours(args) -> dict[str, float]:
    import torch
    from torch.profiler import record_function

    from eagle3_train.model.draft import Eagle3Draft

    arch = ours_arch(args)
    from eagle3_train.components.build import speed_up
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
    if args.head == "frozen":  # as speculators keeps it
        model.lm_head.weight.requires_grad_(False)
    # as eagle3-train sets a run up (eagle3_train.components.build: speed_up, make_optimizer)
    train = SimpleNamespace(compile="always" if args.compile else "never", recompute=args.recompute)
    config = SimpleNamespace(train=train, export=SimpleNamespace(include_embeddings=False))
    precision = "bf16" if args.dtype == "bfloat16" else "no"
    speed_up(
        model, config, SimpleNamespace(mixed_precision=precision, device=torch.device(args.device))
    )
    model.to(args.device)
    params = model.trainable_parameters()
    opt = _optimizer(args.optimizer, model, params, fused=args.device == "cuda")
    host = _batch(args)
    b = _on_device(host, args)
    objective, decay, max_grad_norm = _objective(args.objective)
    phases["build"] = time.perf_counter() - built

    def step() -> None:
        # the trainer's step: alignment on the host, moved with the batch; clipping
        al = align(host["input_ids"], host["loss_mask"], host["cu_seqlens"], args.ttt_steps).to(
            args.device
        )
        with _autocast(args), record_function("bench.forward"):
            loss, _ = model(
                b["aux_hidden_states"],
                b["last_hidden_state"],
                b["input_ids"],
                b["loss_mask"],
                b["cu_seqlens"],
                args.ttt_steps,
                decay,
                alignment=al,
                objective=objective,
            )
        with record_function("bench.backward"):
            loss.backward()
        with record_function("bench.optimizer"):
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)

    result = _time(step, args, b["input_ids"].shape[0], phases)
    if args.sync_check and args.device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            result["host_syncs_in_step"] = "none"
        except RuntimeError as e:
            result["host_syncs_in_step"] = raised_at(e)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result["pageable_copies_in_step"] = pageable_copies(step) or "none"
    if args.profile:
        result["part_times_ms"] = part_times(step, args.device)
    if args.profile and args.device == "cuda":
        result["top_kernels"] = top_kernels(step)
    return result


def run_speculators(args) -> dict[str, float]:
    import torch
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import LlamaConfig

    heads, kv, head_dim = heads_of(args)
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
    cfg = speculators_config(
        tl,
        args.v_draft,
        [1, 2, 3],
        args.ttt_steps,
        None,
        ["LlamaForCausalLM"],
        norm_before_residual=False,
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
    optimizers = _speculators_optimizers(args.optimizer, model, params)
    b = _batch(args)
    # speculators' own per-sample shift, then packing
    cat, doc = pack_documents(b)
    if args.device == "cuda":  # FlexAttention's block mask: pad to whole 128-token blocks, as
        # speculators' collator pads to its fixed length (a padding document, loss_mask 0)
        pad = -cat["input_ids"].shape[1] % 128
        cat = {
            k: torch.nn.functional.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) for k, v in cat.items()
        }
        doc = torch.nn.functional.pad(doc, (0, pad), value=len(b["cu_seqlens"]) - 1)
    cat, doc = _on_device(cat, args), doc.to(args.device)
    # its eager loss: the fused Triton one needs a GPU and, under torch 2.11's dynamo, fails
    # ("ListVariable ... is already tracked for mutation", speculators/losses/fused.py)
    loss_config = resolve_loss_config("kl_div", "eager")

    def step() -> None:
        with warnings.catch_warnings(), _autocast(args):
            warnings.simplefilter("ignore")
            _, loss, _ = model(
                **cat, document_ids=doc, ttt_steps=args.ttt_steps, loss_config=loss_config
            )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, SPECULATORS_CLIP)
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)

    phases["build"] = time.perf_counter() - built
    return _time(step, args, b["input_ids"].shape[0], phases)


def _speculators_optimizers(name: str, model, params) -> list:
    """speculators' optimizers. ``muon``: its 0.9.0 defaults (``speculators train`` builds them
    with ``build_optimizers``: torch's Muon on the 2-D matrices, the same ones ours' Muon takes,
    AdamW on the rest; ``--muon-lr`` unset is ``--lr``). ``adamw``: AdamW on every trained
    tensor, its default before 0.9.0 and the earlier rows' setting."""
    import torch

    if name == "adamw":
        return [torch.optim.AdamW(params, lr=1e-4)]
    from speculators.train.config.schema import OptimizerArgs
    from speculators.train.optimizers import build_optimizers

    defaults = OptimizerArgs()
    return build_optimizers(model, defaults.model_copy(update={"muon_lr": defaults.lr}))


def _on_device(batch: dict, args) -> dict:
    return {k: v.to(args.device) if hasattr(v, "to") else v for k, v in batch.items()}


def _autocast(args):
    """Mixed precision as the trainer runs it (fp32 master weights, autocast compute)."""
    import torch

    return torch.autocast(args.device, torch.bfloat16, enabled=args.dtype == "bfloat16")


def _time(step, args, tokens: int, phases: dict[str, float]) -> dict[str, object]:
    """Seconds per step over ``args.steps`` after ``args.warmup`` steps (compilation
    included), and the side's phases in seconds: imports, build, warmup, timed steps."""
    import psutil
    import torch

    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    base_rss = psutil.Process().memory_info().rss / 2**20  # weights and batch in place, no step yet
    warm = time.perf_counter()
    for _ in range(args.warmup):
        step()
    sync()
    phases["warmup"] = time.perf_counter() - warm
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / args.steps
    # CPU seconds of this process per step: on a shared machine less disturbed by other
    # jobs than wall time (with one thread; OpenMP threads may spin-wait)
    cpu_seconds = (time.process_time() - cpu) / args.steps
    phases["timed"] = seconds * args.steps
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result = {
        "phases_s": {k: round(v, 2) for k, v in phases.items()},
        "seconds_per_step": seconds,
        "tokens_per_s": tokens / seconds,
        "cpu_seconds_per_step": cpu_seconds,
        "peak_rss_mib": peak_rss,
    }
    if args.device == "cuda":  # the device's peak over the timed steps (weights, optimizer,
        # activations); the step's below is then over the device memory held before it
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    # what a step adds at its peak over the memory held before it (activations, and on CPU the
    # optimizer's state, created by the first step): grows with T
    result["step_peak_mib"] = (
        (torch.cuda.max_memory_allocated() - base_gpu) / 2**20
        if args.device == "cuda"
        else peak_rss - base_rss
    )
    return result


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
    return make_muon(model, load_config(recipe), cuda=fused)


def _objective(name: str):
    """(train.objective, ttt_step_loss_decay, max_grad_norm) of ours. ``plain``: what
    speculators trains — plain TTT KL (no top-k term), no step decay, gradients clipped as its
    trainer clips them — so the two sides' rows compare the same work. ``defaults``: eagle3-
    train's own train: defaults (the HASS top-k term, step decay, its clipping)."""
    from eagle3_train.config.train_config import TrainLoopConfig
    from eagle3_train.model.draft import PLAIN_TTT

    if name == "plain":
        return PLAIN_TTT, 1.0, SPECULATORS_CLIP
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


def raised_at(e: BaseException, frames: int = 5) -> str:
    """Where an error was raised: the traceback's last frames (the op and the line of ours or
    speculators' that called it) and the message's first line — c10's text alone says that
    a step synchronised, not which op did."""
    tail = traceback.extract_tb(e.__traceback__)[-frames:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in reversed(tail))
    return f"{where} :: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def pageable_copies(step) -> list[str]:
    """The host→device copies of one step whose source is pageable memory, each with the line
    that made it: a non-blocking copy from pageable memory is staged through a buffer the host
    waits for, which the sync debug mode does not see. (Compiled code runs eagerly under the
    watch: this step checks the copies, it is not timed.)"""
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


def top_kernels(step, count: int = 12) -> list[list]:
    """[name, CUDA ms, calls] of the kernels that took most of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        import torch

        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    return [[e.key[:90], round(e.device_time_total / 1e3, 3), e.count] for e in rows[:count]]


# kernel (CUDA) or op (CPU) names of each part, by substring, the first match counting
KERNEL_PARTS = {
    "attention": ("flash", "fmha", "attention", "sdpa"),
    "loss": ("log_softmax", "logsoftmax", "_softmax", "kl_div"),
    "gemm": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm",
             "aten::bmm", "aten::baddbmm"),
    "copies": ("memcpy", "memset", "aten::copy_", "aten::_to_copy"),
}  # fmt: skip
PHASES = ("forward", "backward", "optimizer")  # the step's record_function ranges: "bench.<phase>"


def part_times(step, device: str) -> dict[str, float]:
    """One profiled step, in ms: its phases (``bench.forward``, ``bench.backward`` and
    ``bench.optimizer`` ranges, which the step opens) and its kernels by part (KERNEL_PARTS,
    the rest "other"): on CUDA the kernels' device time, on CPU the ops' own time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    times = {f"phase_{phase}": 0.0 for phase in PHASES}
    times.update({part: 0.0 for part in (*KERNEL_PARTS, "other")})
    for event in prof.key_averages():
        name = event.key
        if name.startswith("bench."):
            phase = name.removeprefix("bench.")
            if phase in PHASES:
                total = event.device_time_total if cuda else event.cpu_time_total
                times[f"phase_{phase}"] += total / 1e3
            continue
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if not own:
            continue
        lowered = name.lower()
        part = next(
            (p for p, keys in KERNEL_PARTS.items() if any(k in lowered for k in keys)), "other"
        )
        times[part] += own / 1e3
    return {k: round(v, 3) for k, v in times.items()}
