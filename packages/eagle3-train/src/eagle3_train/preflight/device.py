"""Preflight on this device: one real batch forward and backward, the memory and disk a run
needs against what is free, and the flash attention kernel against its reference."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from eagle3_train.components.build import build_model
from eagle3_train.data.dataset import plan_epoch, split_indices
from eagle3_train.data.inputs import RunInputs
from eagle3_train.data.loader import ShardReader, to_device
from eagle3_train.model.arch import DraftArch
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.flash_attention import (
    attention_kernel_note,
    compile_flash_attention,
    flash_self_check,
    resolve_attention,
)
from eagle3_train.preflight.report import Finding, error, ok, warning

# ---------------------------------------------------------------------------------------
# One real batch, forward and backward


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def check_dry_run(
    inputs: RunInputs, arch: DraftArch, device: torch.device
) -> tuple[list[Finding], dict[str, float]]:
    cfg = inputs.config
    if inputs.stream is not None:  # the first window (waits for the producer to seal it)
        inputs.stream.open(0)
    train_idx, _ = split_indices(inputs.dataset, cfg.data.validation_fraction)
    plan = plan_epoch(
        inputs.dataset.num_tokens, train_idx, cfg.data.max_tokens_per_batch, cfg.train.seed, 0
    )
    if not plan:
        return error(
            "dry_run",
            f"{inputs.dataset.root}: no trainable sample (all shorter than 2 tokens or held out)",
        ), {}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = _rss_mib()
    model = build_model(inputs, arch, cfg.train.seed).to(device)
    batch = to_device(ShardReader(inputs.dataset).read(plan[0]), device)
    start = time.perf_counter()
    precision = cfg.train.mixed_precision
    autocast = cuda and precision in ("auto", "bf16")
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, stats = model(
            batch["aux_hidden_states"],
            batch["last_hidden_state"],
            batch["input_ids"],
            batch["loss_mask"],
            batch["cu_seqlens"],
            cfg.train.ttt_steps,
            cfg.train.ttt_step_loss_decay,
            objective=cfg.train.objective,
        )
    after_forward = _rss_mib()  # activations are alive until backward frees them
    loss.backward()
    seconds = time.perf_counter() - start
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    peak = (
        torch.cuda.max_memory_allocated(device) / 2**20
        if cuda
        else max(after_forward - before, _rss_mib() - before, 0.0)
    )
    info = {"seconds": seconds, "peak_mib": peak, "tokens": float(batch["input_ids"].shape[0])}
    out = []
    if not torch.isfinite(loss):
        out += error(
            "dry_run",
            f"loss is {float(loss.detach())} on the first batch (samples {plan[0][:3]}...)",
        )
    if any(g is None for g in grads):
        out += error("dry_run", "some trainable parameters received no gradient")
    elif not all(bool(torch.isfinite(g).all()) for g in grads):
        out += error("dry_run", "non-finite gradients on the first batch")
    if int(stats[0, 2]) == 0:
        out += warning("dry_run", "the first batch has no scored token (loss_mask all zero?)")
    if not out:
        out += ok(
            "dry_run",
            f"forward+backward of {int(info['tokens'])} tokens × {cfg.train.ttt_steps} TTT steps: "
            f"loss {float(loss.detach()):.4f}, {seconds:.2f} s, ~{peak:.0f} MiB",
        )
    del model, batch
    return out, info


def check_memory(
    inputs: RunInputs,
    arch: DraftArch,
    device: torch.device,
    world: int,
    zero_stage: int,
    dry: dict[str, float],
) -> list[Finding]:
    import psutil

    with torch.device("meta"):
        model = Eagle3Draft(arch)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) + sum(
        b.numel() for b in model.buffers()
    )
    # fp32 weights + grads + AdamW moments; ZeRO shards optimizer (1+), grads (2+), weights (3)
    per_param = (
        4 * (1 if zero_stage < 3 else 1 / world)
        + 4 * (1 if zero_stage < 2 else 1 / world)
        + 8 * (1 / world if zero_stage >= 1 else 1)
    )
    states = trainable * per_param + frozen * 4
    need = states + dry.get("peak_mib", 0.0) * 2**20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = f"GPU {device}"
    else:
        free = psutil.virtual_memory().available
        where = "host RAM"
    out = []
    gib = 2**30
    msg = (
        f"estimated {need / gib:.2f} GiB per process ({trainable / 1e6:.1f}M trainable, "
        f"{frozen / 1e6:.1f}M frozen, activations {dry.get('peak_mib', 0):.0f} MiB measured) "
        f"vs {free / gib:.2f} GiB free {where}"
    )
    procs_here = world if device.type != "cuda" else 1
    if need * procs_here > free:
        out += error("memory", msg + f" × {procs_here} processes: does not fit")
    elif need * procs_here > 0.8 * free:
        out += warning("memory", msg + " (tight)")
    else:
        out += ok("memory", msg)
    ckpt = trainable * 12 * inputs.config.train.keep_checkpoints + trainable * 4 * 3
    parent = Path(inputs.config.output_dir)
    while not parent.exists():
        parent = parent.parent
    disk_free = shutil.disk_usage(parent).free
    if ckpt > disk_free:
        out += error(
            "disk",
            f"checkpoints need ~{ckpt / gib:.2f} GiB, {disk_free / gib:.2f} GiB free under {parent}",
        )
    return out


def check_attention_kernel(
    arch: DraftArch, device: torch.device, mixed: str, compiled: bool = False
) -> list[Finding]:
    """Which attention the step runs, and why (an "ok" finding). Where the flash path will run,
    it is first compared with the chunked reference on this device (values and gradients, with
    a negative control), as the step will run it (compiled under train.compile): a kernel of
    another torch that lays out its log-sum-exp differently, or a compiled graph that computes
    something else, stops the run here, not in a silently worse draft."""
    dtype = torch.bfloat16 if mixed == "bf16" else torch.float32
    chosen = ok("attention", attention_kernel_note(arch.attention, device, dtype))
    if resolve_attention(arch.attention, device, dtype) != "flash":
        return chosen
    compile_flash_attention(compiled)  # what speed_up sets for the step
    try:
        problems = flash_self_check(device)
    except (RuntimeError, TypeError) as e:  # an op missing or with another signature
        problems = [f"{type(e).__name__}: {e}"]
    if not problems:
        return chosen
    return error(
        "attention",
        f"draft.attention flash on {device} (torch {torch.__version__}"
        f"{', compiled' if compiled else ''}) disagrees with the chunked reference: "
        f"{'; '.join(problems)}. Set draft.attention: chunked"
        + (" (or train.compile: never)" if compiled else ""),
    )
