"""The training loop under Accelerate (single process, DDP, DeepSpeed ZeRO-2/3).

``_train`` reads top to bottom in named steps: ``start_accelerator`` →
``load_and_check_inputs`` (preflight) → ``prepare_output_dir`` → ``set_up_run`` (model,
optimizer and schedule from ``build.py``, the data order, resume, trackers) → ``Loop``:
``run_epochs`` over segments (``train_segment``: ``micro_batch``, ``after_optimizer_step`` with
``log_metrics`` and the ``validate`` / ``checkpoint`` points; ``end_segment``, ``end_epoch``)
→ ``finish`` (last validation and checkpoint, final export, ``publish_and_record``).
Distribution is applied from outside (accelerate.prepare); the model knows nothing of it.

Files under ``output_dir``:
  run.yaml                 the resolved config of this run
  metrics.jsonl            one JSON line per logged step / validation (main process)
  checkpoints/step-N/      resumable state: model, optimizer, RNG (accelerate.save_state),
                           trainer_state.json (step, data position, scheduler, best);
                           written as .tmp-step-N and renamed when complete
  checkpoints/latest.json  the newest complete checkpoint
  exports/step-N/          speculators-format drafts (validated exports at evaluations)
  draft/                   the deliverable: the best export (or the last without validation)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from eagle3_schemas.atomic import write_json_atomic
from eagle3_schemas.diskspace import DiskFull, check_free, disk_full, is_disk_full
from eagle3_schemas.stream import CONSUMER_STOPPED
from eagle3_schemas.validate import validate
from eagle3_train.arch import DraftArch
from eagle3_train.build import build_model, lr_lambda, make_optimizer, speed_up
from eagle3_train.config import Config, dump_config
from eagle3_train.data import plan_epoch, rank_batches
from eagle3_train.export import draft_config, export_weights, write_checkpoint
from eagle3_train.inputs import (
    RunInputs,
    checkpoint_lineage,
    load_inputs,
    resolve_arch,
)
from eagle3_train.loader import make_loader, to_device
from eagle3_train.loss import NUM_STATS, align, summarize, unpack_stats
from eagle3_train.order import FinishedWindows, GlobalOrder, Packing, WindowOrder
from eagle3_train.preempt import Preemption, parse_signals
from eagle3_train.preflight import PreflightError, run_preflight
from eagle3_train.stream import StreamWindows
from eagle3_train.watchdog import StepWatchdog

log = logging.getLogger("eagle3_train")

EXIT_PREFLIGHT = 2
EXIT_NAN = 3
EXIT_STREAM = 4
EXIT_PREEMPTED = 5
EXIT_CORRUPT = 6
EXIT_PEER = 8

# how gloo / NCCL / torch.distributed word a peer that is gone or silent
_PEER_FAILURES = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Timeout",
    "NCCL",
    "ProcessGroup",
)


def is_collective_failure(error: BaseException) -> bool:
    """A torch.distributed collective failed: another rank died or stopped answering."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(s in text for s in _PEER_FAILURES)


def collective_failure_message(error: BaseException, config: Config) -> str:
    rank = os.environ.get("RANK", "?")
    pointer = Path(config.output_dir) / "checkpoints" / "latest.json"
    last = "none yet"
    if pointer.is_file():
        last = str(pointer.parent / json.loads(pointer.read_text(encoding="utf-8"))["path"])
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return (
        f"rank {rank}: a collective with the other ranks failed ({first}): another rank died "
        f"or answered nothing for train.collective_timeout_s={config.train.collective_timeout_s:g}"
        f" s. Stopped; last checkpoint: {last}. Look at the other ranks' logs, then relaunch the "
        "same command on every node to resume from it"
    )


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (NaN loss); the message says why and what was kept."""


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # current epoch
    batches_done: int = 0  # micro-batches of this rank's epoch plan consumed
    tokens: int = 0  # tokens seen, all ranks
    best_value: float | None = None
    best_step: int | None = None
    best_export: str | None = None
    last_checkpoint: str | None = None
    validated_step: int | None = None
    scheduler: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1
    lineage: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


# ---------------------------------------------------------------------------------------
# Setup


def _is_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def available_trackers(names: list[str]) -> list[str]:
    import importlib.util

    out = []
    for name in names:
        if name == "none":
            continue
        if name == "tensorboard" and not (
            importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX")
        ):
            log.warning("tensorboard is not installed: metrics go to metrics.jsonl only")
            continue
        if name == "wandb" and not importlib.util.find_spec("wandb"):
            raise RuntimeError("train.trackers has 'wandb' but wandb is not installed")
        out.append(name)
    return out


def make_accelerator(config: Config, with_trackers: bool = True):
    """An Accelerator that works on GPU and on CPU (gloo), plain, DDP or DeepSpeed."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    t = config.train
    cuda = torch.cuda.is_available()
    deepspeed = _is_deepspeed()
    # The frozen target buffers never change: do not re-broadcast them every forward.
    handlers: list[Any] = [DistributedDataParallelKwargs(broadcast_buffers=False)]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Without CUDA, DeepSpeed under Accelerate 1.x reports one process per rank and
        # gather crashes unless the process group is gloo (ENVIRONMENT.md). In a single
        # process a backend must not be named at all (Accelerate would ask for a group).
        # The timeout bounds every collective (DeepSpeed's init_distributed takes it too).
        handlers.append(
            InitProcessGroupKwargs(
                backend=None if cuda else "gloo",
                timeout=timedelta(seconds=t.collective_timeout_s),
            )
        )
    precision = t.mixed_precision
    if precision == "auto":
        precision = "bf16" if cuda else "no"
    trackers = available_trackers(t.trackers) if with_trackers else []
    accelerator = Accelerator(
        # A MULTI_CPU config starts one process; DDP on CPU needs cpu=True under a multi-process
        # launch. DeepSpeed on CPU picks its CPU accelerator itself (DS_ACCELERATOR=cpu).
        cpu=not cuda and not deepspeed,
        mixed_precision=precision,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
        log_with=trackers or None,
        project_dir=config.output_dir,
        kwargs_handlers=handlers,
    )
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        ds = plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = 1  # one packed sequence per micro-batch
        ds["gradient_accumulation_steps"] = t.gradient_accumulation_steps
        ds["gradient_clipping"] = t.max_grad_norm
        ds.setdefault("zero_optimization", {})
        # exports gather the full weights on rank 0
        ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    return accelerator


# ---------------------------------------------------------------------------------------
# Checkpoints


def find_checkpoint(config: Config) -> Path | None:
    resume = config.train.resume
    if resume == "never":
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(
                f"train.resume: {path} is not a checkpoint (no trainer_state.json)"
            )
        return path
    pointer = Path(config.output_dir) / "checkpoints" / "latest.json"
    if not pointer.is_file():
        return None
    path = Path(json.loads(pointer.read_text(encoding="utf-8"))["path"])
    if not path.is_absolute():
        path = Path(config.output_dir) / "checkpoints" / path
    return path if (path / "trainer_state.json").is_file() else None


def checkpoint_bytes(model, last: str | None) -> int:
    """What the next checkpoint needs: the last one's size, else the weights and AdamW's two
    moments in float32 (plus 32 KiB for RNG, scheduler and state files)."""
    if last and Path(last).is_dir():
        return sum(f.stat().st_size for f in Path(last).rglob("*") if f.is_file())
    weights = sum(p.numel() * 4 for p in model.parameters())
    moments = sum(p.numel() * 8 for p in model.parameters() if p.requires_grad)
    return weights + moments + (32 << 10)


def save_checkpoint(
    accelerator, state: TrainerState, scheduler, config: Config, model=None
) -> Path:
    """Resumable state, written under a temporary name and renamed when every rank is done.
    Free space for it is checked first (DiskFull, nothing written); a write that still hits
    a full disk removes the temporary directory and raises DiskFull naming path and sizes."""
    final = Path(_checkpoint_path(config, state.step))
    root, name = final.parent, final.name
    tmp = root / f".tmp-{name}"
    needed = checkpoint_bytes(model, state.last_checkpoint) if model is not None else 0
    problem = None
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        try:
            check_free(root, f"checkpoint {name}", needed)
        except DiskFull as e:
            problem = e
    if _agree_on_failure(accelerator, problem is not None):
        raise problem or DiskFull(f"{root}: rank 0 found no room for checkpoint {name}")
    previous = state.last_checkpoint
    state.last_checkpoint = str(final)  # on every rank: later decisions must agree
    try:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
    except Exception as e:  # OSError, or safetensors' SafetensorError
        if not is_disk_full(e):
            raise
        state.last_checkpoint = previous
        shutil.rmtree(tmp, ignore_errors=True)
        raise disk_full(tmp, f"checkpoint {name}", needed or None, e) from e
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state.scheduler = scheduler.state_dict()
        try:
            write_json_atomic(tmp / "trainer_state.json", state.to_json())
        except OSError as e:  # (without trainer_state.json the directory is no checkpoint)
            if not is_disk_full(e):
                raise
            state.last_checkpoint = previous
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_full(tmp, f"checkpoint {name}", needed or None, e) from e
        if final.exists():  # the same step saved twice (epoch end == save step)
            shutil.rmtree(final)
        os.rename(tmp, final)
        write_json_atomic(root / "latest.json", {"path": name, "step": state.step})
        kept = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in kept[: max(0, len(kept) - config.train.keep_checkpoints)]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint saved: %s (step %d)", final, state.step)
    accelerator.wait_for_everyone()
    return final


def _checkpoint_path(config: Config, step: int) -> str:
    return str(Path(config.output_dir) / "checkpoints" / f"step-{step:08d}")


def load_checkpoint(accelerator, path: Path, scheduler) -> TrainerState:
    data = json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    state = TrainerState(**data)
    if state.world_size != accelerator.num_processes:
        raise RuntimeError(
            f"{path}: saved with {state.world_size} processes but this run has "
            f"{accelerator.num_processes}; the data position is per rank — resume with the "
            "same number of processes"
        )
    accelerator.load_state(str(path))
    scheduler.load_state_dict(state.scheduler)
    return state


# ---------------------------------------------------------------------------------------
# Export


def export_draft(
    accelerator, model, inputs: RunInputs, arch: DraftArch, state: TrainerState, metrics: dict
) -> Path | None:
    """Gather the weights (every rank takes part under ZeRO-3) and write a validated export."""
    full = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        return None
    cfg = inputs.config
    out = Path(cfg.output_dir) / "exports" / f"step-{state.step:08d}"
    if out.exists():
        return out
    unwrapped = accelerator.unwrap_model(model)
    target_arch = (inputs.target_config or {}).get("architectures") or [
        inputs.dataset.header["target"]["architecture"]
    ]
    config_json = draft_config(
        arch,
        inputs.aux_layer_ids,
        cfg.target.name_or_path or cfg.target.path,
        list(target_arch),
        cfg.train.ttt_steps,
    )
    weights = export_weights(
        full,
        inputs.vocab.d2t,
        inputs.vocab.t2d,
        cfg.export.dtype,
        unwrapped.embed_tokens if cfg.export.include_embeddings else None,
    )
    lineage = checkpoint_lineage(inputs)
    training = {
        "steps": state.step,
        "tokens": state.tokens,
        "epoch": state.epoch,
        "metrics": metrics,
    }
    try:
        write_checkpoint(out, config_json, weights, lineage, inputs.aux_layer_ids, training, cfg)
    except Exception as e:  # (its temporary directory is gone: atomic_directory)
        if not is_disk_full(e):
            raise
        needed = sum(t.numel() * t.element_size() for t in weights.values())
        raise disk_full(out, f"export {out.name}", needed, e) from e
    problems = validate(out)
    if problems:
        raise RuntimeError(
            f"{out}: the export does not validate:\n  " + "\n  ".join(map(str, problems))
        )
    return out


def publish(export: Path, output_dir: Path) -> Path:
    """Copy ``export`` to ``output_dir/draft`` (temp copy, then swap)."""
    final = output_dir / "draft"
    tmp = output_dir / ".tmp-draft"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(export, tmp)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not is_disk_full(e):
            raise
        needed = sum(f.stat().st_size for f in export.rglob("*") if f.is_file())
        raise disk_full(final, "the published draft", needed, e) from e
    if final.exists():
        old = output_dir / ".old-draft"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    return final


# ---------------------------------------------------------------------------------------
# The loop


class MetricWindow:
    """Sums of per-step counts over micro-batches, kept on the model's device (no host sync
    per batch); reduced across ranks when logged."""

    def __init__(self, ttt_steps: int, finite_only: bool = False) -> None:
        self.ttt_steps = ttt_steps
        # skip mode: a batch with a non-finite loss is left out of the sums (on the device)
        self.finite_only = finite_only
        self.sums: torch.Tensor | None = None  # [ttt_steps·NUM_STATS, loss, batches], float64
        self.tokens = 0
        self.corrupt = 0  # samples the loader left out (data.on_corrupt: skip)

    def add(self, loss: torch.Tensor, stats: torch.Tensor, tokens: int) -> None:
        loss = loss.detach().double().reshape(1)
        row = torch.cat([stats.detach().flatten(), loss, torch.ones_like(loss)])
        if self.finite_only:
            row = torch.where(torch.isfinite(loss), row, torch.zeros_like(row))
        self.sums = row if self.sums is None else self.sums + row
        self.tokens += tokens

    def reduce(self, accelerator) -> tuple[dict[str, float], int]:
        k = self.ttt_steps
        n = NUM_STATS * k
        sums = self.sums if self.sums is not None else torch.zeros(n + 2, dtype=torch.float64)
        counts = torch.tensor([self.tokens, self.corrupt], dtype=torch.float64)
        packed = torch.cat([sums.to(accelerator.device), counts.to(accelerator.device)])
        packed = accelerator.reduce(packed, reduction="sum").cpu()
        stats = packed[:n].view(k, NUM_STATS)
        loss, batches, tokens, corrupt = packed[n:].tolist()
        out = summarize(unpack_stats(stats), batches)
        out["loss"] = loss / max(batches, 1.0)
        if corrupt:
            out["corrupt_samples"] = corrupt
        return out, int(tokens)


@dataclass
class BadStep:
    """Where a checked value was taken, for the message if it turns out non-finite."""

    what: str  # "loss" | "gradient norm"
    value: torch.Tensor
    step: int
    epoch: int
    batch: int
    sample_ids: list[Any]


class NonFiniteWatch:
    """Stops the run on a non-finite loss or gradient norm without a host sync per step.

    Each verdict (one small tensor, all-reduced so every rank agrees) is copied to the host
    asynchronously. On CUDA it is read ``lag`` verdicts later, when the next step's work is
    already queued, so the GPU never waits for the host; on CPU at once (a bad loss then stops
    the run before its backward). Whatever is saved (checkpoint, validation, export) first
    drains every pending verdict: nothing of a bad step is ever kept.
    """

    def __init__(self, accelerator, lag: int) -> None:
        self.accelerator = accelerator
        self.lag = lag
        self.pending: list[tuple[torch.Tensor, Any, BadStep]] = []

    def record(
        self, value: torch.Tensor, where: BadStep, metrics_path: Path, last: str | None
    ) -> None:
        bad = (~torch.isfinite(value.detach().float())).float().reshape(1)
        if self.accelerator.num_processes > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        event = None
        if bad.is_cuda:
            host = torch.empty(1, dtype=bad.dtype, pin_memory=True)
            host.copy_(bad, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = bad
        self.pending.append((host, event, where))
        self.drain(metrics_path, last, keep=self.lag)

    def drain(self, metrics_path: Path, last_checkpoint: str | None, keep: int = 0) -> None:
        while len(self.pending) > keep:
            host, event, where = self.pending.pop(0)
            if event is not None:
                event.synchronize()
            if float(host[0]) > 0:
                _stop_nan(self.accelerator, where, last_checkpoint, metrics_path)

    def step_optimizer(self, optimizer) -> None:
        optimizer.step()

    def end_step(self, metrics_path: Path, last_checkpoint: str | None) -> None:
        """(stop mode: every verdict was queued by ``record``)"""


def _host_copy(flags: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``flags`` copied to the host without waiting (CUDA: pinned buffer + event)."""
    if not flags.is_cuda:
        return flags.clone(), None
    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
    host.copy_(flags, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


def fused_found_inf(optimizer) -> bool:
    """True when ``optimizer`` (or the one Accelerate wraps) is torch's fused Adam/AdamW, whose
    kernel reads an ``found_inf`` tensor attribute on the device and, when it is non-zero,
    leaves parameters, moments and step counts untouched (torch/optim/adam.py
    ``_fused_adam``; GradScaler sets it the same way)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return isinstance(inner, torch.optim.Adam) and all(g.get("fused") for g in inner.param_groups)


class NonFiniteSkip:
    """train.on_non_finite: skip. An optimizer step with a non-finite loss (any micro-batch,
    any rank) or gradient norm changes nothing; the run stops after ``max_in_row`` such steps
    in a row.

    Per optimizer step the verdicts sum into one small device tensor ``[this rank's bad
    losses, all ranks' bad losses, bad gradient norm]``. The skip itself needs no host: with
    torch's fused AdamW the verdict is handed to the kernel as ``found_inf``; with any other
    optimizer it is read on the host before the step (CPU: free, the value is there; CUDA:
    one sync per step). The record — a "skip" event with the sample ids, the count in a row,
    the stop — is read ``lag`` steps later, as NonFiniteWatch reads its verdicts.
    """

    def __init__(self, accelerator, lag: int, max_in_row: int) -> None:
        self.accelerator = accelerator
        self.lag = lag
        self.max_in_row = max_in_row
        self.flags: torch.Tensor | None = None
        self.where: list[BadStep] = []
        self.pending: list[tuple[torch.Tensor, Any, list[BadStep]]] = []
        self.in_row = 0
        self.skipped = 0

    def record(
        self, value: torch.Tensor, where: BadStep, metrics_path: Path, last: str | None
    ) -> None:
        bad = (~torch.isfinite(value.detach().float())).float().reshape(1)
        zero = torch.zeros_like(bad)
        if where.what == "loss":
            every = bad
            if self.accelerator.num_processes > 1:
                every = self.accelerator.reduce(bad.clone(), reduction="sum")
            row = torch.cat([bad, every, zero])
            self.where.append(where)
        else:  # the gradient norm is the same on every rank
            row = torch.cat([zero, zero, bad])
        self.flags = row if self.flags is None else self.flags + row

    def found_inf(self) -> torch.Tensor:
        """1.0 when this optimizer step must be skipped, as a float32 scalar on the device."""
        assert self.flags is not None, "no verdict recorded for this step"
        return (self.flags[1:].sum() > 0).float()

    def step_optimizer(self, optimizer) -> None:
        if fused_found_inf(optimizer):
            inner = getattr(optimizer, "optimizer", optimizer)
            inner.found_inf = self.found_inf()
            try:
                optimizer.step()
            finally:
                del inner.found_inf
        elif float(self.found_inf()) == 0:  # host read (CPU: the value is already here)
            optimizer.step()

    def end_step(self, metrics_path: Path, last_checkpoint: str | None) -> None:
        """The optimizer step is done: queue its verdict, read those ``lag`` steps old."""
        if self.flags is None:
            return
        host, event = _host_copy(self.flags)
        self.pending.append((host, event, self.where))
        self.flags, self.where = None, []
        self.drain(metrics_path, last_checkpoint, keep=self.lag)

    def drain(self, metrics_path: Path, last_checkpoint: str | None, keep: int = 0) -> None:
        while len(self.pending) > keep:
            host, event, wheres = self.pending.pop(0)
            if event is not None:
                event.synchronize()
            mine, ranks, grad = (float(x) for x in host.tolist())
            if ranks == 0 and grad == 0:
                self.in_row = 0
                continue
            self.in_row += 1
            self.skipped += 1
            self._report(wheres, mine > 0, int(ranks), grad > 0, metrics_path)
            if self.in_row >= self.max_in_row:
                self._stop(wheres, last_checkpoint, metrics_path)

    def _report(
        self, wheres: list[BadStep], mine: bool, ranks: int, grad: bool, metrics_path: Path
    ) -> None:
        acc = self.accelerator
        first = wheres[0]
        ids = [i for w in wheres for i in w.sample_ids]
        bad_ids = [i for w in wheres if not math.isfinite(float(w.value)) for i in w.sample_ids]
        what = "loss" if ranks else "gradient norm"
        message = (
            f"step {first.step} skipped: {what} is not finite (epoch {first.epoch}, batches "
            f"from {first.batch} of rank {acc.process_index}; "
            + (f"this rank's samples {bad_ids}" if mine else f"{ranks} rank(s) with a bad loss")
            + f"); {self.in_row} in a row, {self.skipped} in all; the run stops at "
            f"{self.max_in_row} in a row"
        )
        log.warning("%s", message)
        if mine or acc.is_main_process:  # every rank with a bad sample names its own ids
            record = {
                "event": "skip",
                "step": first.step,
                "epoch": first.epoch,
                "batch": first.batch,
                "rank": acc.process_index,
                "what": what,
                "ranks_with_bad_loss": ranks,
                "gradient_norm_bad": grad,
                "sample_ids": bad_ids if mine else ids,
                "in_row": self.in_row,
                "skipped_total": self.skipped,
            }
            _write_metrics(metrics_path, record)

    def _stop(self, wheres: list[BadStep], last: str | None, metrics_path: Path) -> None:
        message = (
            f"{self.in_row} optimizer steps in a row had a non-finite loss or gradient norm "
            f"(train.max_skips_in_row = {self.max_in_row}; the last at step {wheres[0].step}, "
            f"samples {[i for w in wheres for i in w.sample_ids][:5]}). Stopping without "
            f"saving; skipped steps changed no weight, the last checkpoint is good: "
            f"{last or 'none yet'}. Check the inputs (eagle3-schemas validate) or lower "
            "train.lr, then resume from it."
        )
        if self.accelerator.is_main_process:
            _write_metrics(
                metrics_path, {"event": "nan", "step": wheres[0].step, "message": message}
            )
        log.error("%s", message)
        raise TrainingStopped(message)


def _write_metrics(path: Path, record: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()


def note_corrupt(batch: dict[str, Any], step: int, rank: int, metrics_path: Path | None) -> int:
    """Record the samples the loader left out of ``batch`` (data.on_corrupt: skip): a warning
    and, during training, a "corrupt" event per sample from the rank that read it."""
    corrupt = batch.get("corrupt", [])
    for problem in corrupt:
        log.warning("skipped (data.on_corrupt: skip): %s", problem["message"])
        if metrics_path is not None:
            record = {k: v for k, v in problem.items() if k != "message"}
            _write_metrics(metrics_path, {"event": "corrupt", "step": step, "rank": rank, **record})
    return len(corrupt)


def _verify(config: Config) -> str | None:
    return config.data.on_corrupt if config.data.verify_rows else None


def evaluate(
    accelerator, model, inputs: RunInputs, val_idx, config: Config
) -> dict[str, float] | None:
    ds = inputs.dataset
    plan = plan_epoch(ds.num_tokens, val_idx, config.data.max_tokens_per_batch, 0, 0, shuffle=False)
    plan = rank_batches(plan, accelerator.process_index, accelerator.num_processes)
    if config.data.max_validation_batches is not None:
        plan = plan[: config.data.max_validation_batches]
    if not plan:
        return None
    window = MetricWindow(config.train.ttt_steps)
    model.eval()
    with torch.no_grad():
        for batch in make_loader(ds, plan, 0, recycle=True, verify=_verify(config)):
            loss, stats = forward(model, batch, accelerator, config)
            window.add(loss, stats, int(batch["input_ids"].shape[0]))
            window.corrupt += note_corrupt(batch, -1, accelerator.process_index, None)
    model.train()
    metrics, _ = window.reduce(accelerator)
    return {f"val/{k}": v for k, v in metrics.items()}


def forward(model, batch, accelerator, config: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, stats) of one host batch: the TTT alignment is computed on the host (its counts
    are Python ints there) and moved with the batch, so the step needs no host sync."""
    t = config.train
    al = align(batch["input_ids"].long(), batch["loss_mask"], batch["cu_seqlens"], t.ttt_steps)
    b = to_device(batch, accelerator.device)
    with accelerator.autocast():
        return model(
            b["aux_hidden_states"],
            b["last_hidden_state"],
            b["input_ids"],
            b["loss_mask"],
            b["cu_seqlens"],
            t.ttt_steps,
            t.ttt_step_loss_decay,
            alignment=al.to(accelerator.device),
            objective=t.objective,
        )


def _better(value: float, best: float | None, mode: str) -> bool:
    if math.isnan(value):
        return False
    return best is None or (value < best if mode == "min" else value > best)


def _cpu_threads(configured: int | None, accelerator: Any) -> int:
    """Torch threads for this process: the config's, else this machine's cores shared among
    its local processes. `accelerate launch` exports OMP_NUM_THREADS=1 unless told otherwise
    (use_cpu configs excepted), which left a one-process CPU run on one core (measured: the
    whole tiny-recipe run took as long as speculators' two-thread plain loop)."""
    if configured:
        return configured
    if accelerator.device.type != "cpu":
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))  # this machine's
    return max(1, (cores or 1) // max(1, local))


def make_order(
    inputs: RunInputs, config: Config, rank: int, world: int
) -> GlobalOrder | WindowOrder:
    d = config.data
    packing = Packing(
        d.validation_fraction,
        d.max_tokens_per_batch,
        config.train.seed,
        rank,
        world,
        config.train.gradient_accumulation_steps,
    )
    if d.order == "global":
        return GlobalOrder(inputs.dataset, packing)
    source = inputs.stream or FinishedWindows(inputs.dataset, d.window_shards)
    return WindowOrder(source, packing, d.window_passes)


def train(config: Config, preflight_only: bool = False) -> int:
    """Run (or only preflight) training; returns the process exit code."""
    cleanup: list[Callable[[], None]] = []  # signal handlers and the watchdog, when started
    try:
        return _train(config, preflight_only, cleanup)
    finally:
        for undo in cleanup:
            undo()


def _train(config: Config, preflight_only: bool, cleanup: list[Callable[[], None]]) -> int:
    run_started = time.perf_counter()
    if config.train.on_non_finite == "skip" and _is_deepspeed():
        log.error(
            "train.on_non_finite: skip is not available under DeepSpeed (its engine steps the "
            "optimizer inside backward, before the step's verdict is known); use stop"
        )
        return EXIT_PREFLIGHT
    accelerator = start_accelerator(config, preflight_only)
    checked = load_and_check_inputs(config, accelerator, preflight_only)
    if isinstance(checked, int):
        return checked
    if preflight_only:
        return 0
    prepare_output_dir(config, accelerator)
    run = set_up_run(config, accelerator, *checked, run_started)
    if run is None:
        return EXIT_PREFLIGHT
    loop = Loop(run, cleanup)
    loop.run_epochs()
    return loop.finish()


# ---- setup of the run -----------------------------------------------------------------------


@dataclass
class Run:
    """What a run is made of once set up: the pieces the loop composes."""

    config: Config
    accelerator: Any
    inputs: RunInputs
    arch: DraftArch
    model: Any  # prepared by Accelerate
    optimizer: Any
    scheduler: Any
    order: GlobalOrder | WindowOrder
    state: TrainerState
    total_steps: int
    metrics_path: Path
    started: float  # perf_counter at the start of train()

    @property
    def stream(self) -> StreamWindows | None:
        return self.inputs.stream


def start_accelerator(config: Config, preflight_only: bool):
    """The Accelerator, this process's torch threads and (CUDA) matmul precision."""
    t = config.train
    accelerator = make_accelerator(config, with_trackers=not preflight_only)
    torch.set_num_threads(_cpu_threads(t.torch_threads, accelerator))
    if accelerator.device.type == "cuda":
        torch.set_float32_matmul_precision("high" if t.tf32 else "highest")
    return accelerator


def load_and_check_inputs(
    config: Config, accelerator, preflight_only: bool
) -> tuple[RunInputs, DraftArch, Path | None] | int:
    """Inputs and preflight: (inputs, arch, checkpoint to resume from), or EXIT_PREFLIGHT on
    every rank within seconds when any rank found a problem."""
    main = accelerator.is_main_process
    try:
        inputs = load_inputs(config)
        arch = resolve_arch(inputs)
        resume_from = find_checkpoint(config)
        if config.train.preflight or preflight_only:
            report = run_preflight(inputs, arch, accelerator, resume_from, full=main)
            if main:
                log.info("%s", report.render())
            report.raise_on_errors()
    except Exception as e:  # any failure here (even a crash in the dry run) stops every rank
        detail = str(e) if isinstance(e, PreflightError) else f"{type(e).__name__}: {e}"
        log.error("preflight failed (rank %d):\n%s", accelerator.process_index, detail)
        _agree_on_failure(accelerator, True)
        return EXIT_PREFLIGHT
    if _agree_on_failure(accelerator, False):
        return EXIT_PREFLIGHT
    return inputs, arch, resume_from


def prepare_output_dir(config: Config, accelerator) -> None:
    """run.yaml written, temporary checkpoints of a killed save removed (main process)."""
    out_dir = Path(config.output_dir)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "run.yaml").write_text(dump_config(config), encoding="utf-8")
        for stale in (out_dir / "checkpoints").glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed save
    accelerator.wait_for_everyone()


def set_up_run(
    config: Config,
    accelerator,
    inputs: RunInputs,
    arch: DraftArch,
    resume_from: Path | None,
    run_started: float,
) -> Run | None:
    """Model, optimizer, data order, schedule, the resumed state and the trackers; None when
    no optimizer step fits the data (logged)."""
    t = config.train
    main = accelerator.is_main_process
    model = build_model(inputs, arch, t.seed)
    speed_up(model, config, accelerator)
    optimizer = make_optimizer(model, config, accelerator)
    rank, world = accelerator.process_index, accelerator.num_processes
    stream = inputs.stream
    if stream is not None:
        stream.reclaim = config.data.reclaim and main  # one process deletes
        # one process re-hashes each sealed shard, as preflight validates inputs on one
        stream.deep_check = t.validate_inputs and main
        if main:
            (stream.root / CONSUMER_STOPPED).unlink(missing_ok=True)  # running (again)
    order = make_order(inputs, config, rank, world)
    steps_per_epoch = order.steps_per_epoch()
    if steps_per_epoch == 0:
        log.error(
            "no optimizer step fits: %d samples give no whole optimizer step per rank with %d "
            "processes and gradient_accumulation_steps=%d (data.order %s)",
            len(inputs.dataset),
            world,
            t.gradient_accumulation_steps,
            config.data.order,
        )
        return None
    total_steps = steps_per_epoch * t.epochs
    if t.max_steps is not None:
        total_steps = min(total_steps, t.max_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config, total_steps))
    # The scheduler stays outside prepare(): Accelerate would step it once per process.
    model, optimizer = accelerator.prepare(model, optimizer)

    state = TrainerState(world_size=world, lineage=checkpoint_lineage(inputs) if main else {})
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from, scheduler)
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            resume_from,
            state.step,
            state.epoch,
            state.batches_done,
        )
    # TensorBoard's hparams take scalars and strings only
    flat = {
        f"{section}.{k}": (v if isinstance(v, int | float | str | bool) else json.dumps(v))
        for section, values in config.to_dict().items()
        if isinstance(values, dict)
        for k, v in values.items()
    }
    accelerator.init_trackers(t.project_name, config=flat)
    metrics_path = Path(config.output_dir) / "metrics.jsonl"
    if main:
        _write_metrics(
            metrics_path,
            {
                "event": "start",
                "step": state.step,
                "world_size": world,
                "torch_threads": torch.get_num_threads(),
                "resumed_from": str(resume_from) if resume_from else None,
            },
        )
    return Run(
        config,
        accelerator,
        inputs,
        arch,
        model,
        optimizer,
        scheduler,
        order,
        state,
        total_steps,
        metrics_path,
        run_started,
    )


# ---- the loop's steps -----------------------------------------------------------------------


class Loop:
    """The loop over epochs, the order's segments (stream windows) and micro-batches, in named
    steps: one micro-batch (forward, backward, the optimizer step when gradients sync), the
    bookkeeping of an optimizer step (schedule, logging, the save and validate points), the
    end of a segment and of an epoch, and the end of the run (last validation, checkpoint,
    export, publication)."""

    def __init__(self, run: Run, cleanup: list[Callable[[], None]]) -> None:
        self.run = run
        self.config = config = run.config
        self.t = t = config.train
        self.accelerator = accelerator = run.accelerator
        self.state = run.state
        self.main = accelerator.is_main_process
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        self.stream = run.stream
        self.progress = None
        if self.main and t.progress_bar:
            from tqdm.auto import tqdm

            self.progress = tqdm(
                total=run.total_steps, initial=self.state.step, desc="train", dynamic_ncols=True
            )
        self.params = [p for p in run.model.parameters() if p.requires_grad]
        self.skip_mode = t.on_non_finite == "skip"
        self.window = MetricWindow(t.ttt_steps, finite_only=self.skip_mode)
        self.lag = 2 if accelerator.device.type == "cuda" else 0
        self.watch: NonFiniteWatch | NonFiniteSkip = (
            NonFiniteSkip(accelerator, self.lag, t.max_skips_in_row)
            if self.skip_mode
            else NonFiniteWatch(accelerator, self.lag)
        )
        self.done = self.state.step >= run.total_steps
        self.preempt = Preemption(parse_signals(t.preempt_signals), accelerator, self.lag)
        self.preempt.install()
        cleanup.append(self.preempt.uninstall)
        self.preempted = False
        self.dog = self._start_watchdog(cleanup)
        self.started = time.perf_counter()  # of the current logging window
        self.corrupt_total = 0  # samples this rank's loader left out (data.on_corrupt: skip)
        self.last_metrics: dict[str, float] = {}
        # stream windows before this one may be released at the end (None: all of them)
        self.released_through: int | None = None if self.state.epoch >= t.epochs else 0
        self.waited = self.stream.wait_seconds if self.stream is not None else 0.0

    def _start_watchdog(self, cleanup: list[Callable[[], None]]) -> StepWatchdog | None:
        """Several ranks, no stream (a stream's waits for the producer are not hangs): a rank
        whose training step has not advanced for train.collective_timeout_s leaves (exit 8)."""
        if self.world <= 1 or self.stream is not None:
            return None
        t, rank, state = self.t, self.rank, self.state

        def hang_message(idle: float) -> str:
            return (
                f"rank {rank}: no training step finished for {idle:.0f} s (over "
                f"train.collective_timeout_s={t.collective_timeout_s:g} s): another rank died "
                "or stopped answering inside a collective. Stopped; last checkpoint: "
                f"{state.last_checkpoint or 'none yet'}. Look at the other ranks' logs, then "
                "relaunch the same command on every node to resume from it"
            )

        dog = StepWatchdog(t.collective_timeout_s, hang_message, EXIT_PEER)
        dog.start()
        cleanup.append(dog.stop)
        return dog

    # -- the save and validate points

    def safe_to_keep(self) -> None:
        """Every pending non-finite verdict is read before anything is saved."""
        self.watch.drain(self.run.metrics_path, self.state.last_checkpoint)

    def alone(self):
        """Checkpoints, validation, exports: bounded by the process group's own timeout."""
        return self.dog.paused() if self.dog is not None else contextlib.nullcontext()

    def checkpoint(self) -> None:
        """A checkpoint of this step, once every pending verdict is read (watchdog paused)."""
        self.safe_to_keep()
        with self.alone():
            run = self.run
            save_checkpoint(self.accelerator, self.state, run.scheduler, self.config, run.model)

    def validate(self) -> None:
        """Validation (and the best draft's export), likewise."""
        self.safe_to_keep()
        with self.alone():
            self._validate_and_export()

    def _validate_and_export(self) -> None:
        run = self.run
        _validate_and_export(
            self.accelerator,
            run.model,
            run.inputs,
            run.arch,
            run.order.validation_idx,
            self.state,
            self.config,
            run.metrics_path,
            self.last_metrics,
        )

    # -- epochs, segments, micro-batches

    def run_epochs(self) -> None:
        state = self.state
        for epoch in range(state.epoch, self.t.epochs):
            if self.done:
                break
            if epoch != state.epoch:
                state.epoch, state.batches_done = epoch, 0
            epoch_complete = False
            for segment in self.run.order.segments(epoch, state.batches_done):
                self.train_segment(segment, epoch)
                finished = state.batches_done == segment.start + len(segment.batches)
                epoch_complete = finished and segment.last
                if self.done:  # (the loader ends only when the segment is consumed or on done)
                    if segment.window is not None:
                        self.released_through = segment.window + int(finished)
                    break
                self.end_segment(segment)
            if epoch_complete:
                self.end_epoch(epoch)

    def train_segment(self, segment, epoch: int) -> None:
        """The segment's micro-batches until it is consumed or the run is done."""
        config, state = self.config, self.state
        loader = make_loader(
            self.run.inputs.dataset,
            segment.batches,
            config.data.num_workers,
            config.data.prefetch_batches,
            pin_memory=torch.cuda.is_available(),
            recycle=True,  # each batch is done with before the next is fetched
            verify=_verify(config),
        )
        for batch in loader:
            if "corrupt" in batch:
                found = note_corrupt(batch, state.step + 1, self.rank, self.run.metrics_path)
                self.window.corrupt += found
                self.corrupt_total += found
            loss, stats, grad_norm = self.micro_batch(batch, epoch)
            if self.watch_and_count(loss, stats, batch):
                continue  # inside gradient accumulation
            self.after_optimizer_step(epoch, grad_norm)
            if state.step >= self.run.total_steps:
                self.done = True
                break
            if self.preempt.poll():  # the same step on every rank
                self.preempted = self.done = True
                break

    def micro_batch(
        self, batch, epoch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward, backward and, when gradients sync, the clipped optimizer step, each value
        handed to the non-finite watch: (loss, stats, the step's gradient norm or None)."""
        accelerator, state, watch, run = self.accelerator, self.state, self.watch, self.run
        metrics_path = run.metrics_path
        with accelerator.accumulate(run.model):
            loss, stats = forward(run.model, batch, accelerator, self.config)
            where = BadStep(
                "loss",
                loss.detach(),
                state.step + 1,
                epoch,
                state.batches_done,
                batch["sample_ids"],
            )
            watch.record(loss, where, metrics_path, state.last_checkpoint)
            accelerator.backward(loss)
            grad_norm = None
            if accelerator.sync_gradients:
                grad_norm = accelerator.clip_grad_norm_(self.params, self.t.max_grad_norm)
                if grad_norm is not None:
                    grad_norm = torch.as_tensor(grad_norm)
                    where = dataclasses.replace(where, what="gradient norm", value=grad_norm)
                    watch.record(grad_norm, where, metrics_path, state.last_checkpoint)
            if accelerator.sync_gradients:
                watch.step_optimizer(run.optimizer)
            else:
                run.optimizer.step()  # (a no-op inside accumulation)
            run.optimizer.zero_grad(set_to_none=True)
        return loss, stats, grad_norm

    def watch_and_count(self, loss: torch.Tensor, stats: torch.Tensor, batch) -> bool:
        """After a micro-batch: its verdicts queued (at an optimizer step), the data position
        and the watchdog advanced, its stats summed. True while gradients still accumulate."""
        accelerator = self.accelerator
        if accelerator.sync_gradients:
            self.watch.end_step(self.run.metrics_path, self.state.last_checkpoint)
        self.state.batches_done += 1
        if self.dog is not None:
            self.dog.kick()
        self.window.add(loss, stats, int(batch["input_ids"].shape[0]))
        return not accelerator.sync_gradients

    def after_optimizer_step(self, epoch: int, grad_norm: torch.Tensor | None) -> None:
        """The schedule advances, the step is counted, logged when due, and the validate and
        save points of train.eval_every / train.save_every are met."""
        t, state = self.t, self.state
        if self.skip_mode:  # the schedule advances over a skipped first step too
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
                self.run.scheduler.step()
        else:
            self.run.scheduler.step()
        state.step += 1
        if state.step % t.log_every == 0 or state.step == self.run.total_steps:
            self.log_metrics(epoch, grad_norm)
        if self.progress is not None:
            self.progress.update(1)
        if t.eval_every and state.step % t.eval_every == 0:
            self.validate()
        if t.save_every and state.step % t.save_every == 0:
            self.checkpoint()

    def log_metrics(self, epoch: int, grad_norm: torch.Tensor | None) -> None:
        """The logging window's metrics, reduced over ranks: trackers, metrics.jsonl, the
        progress bar; then a new window."""
        t, state, accelerator = self.t, self.state, self.accelerator
        metrics, tokens = self.window.reduce(accelerator)
        state.tokens += tokens
        metrics.update(lr=self.run.scheduler.get_last_lr()[0], epoch=epoch, tokens=state.tokens)
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)
        elapsed = time.perf_counter() - self.started
        metrics["tokens_per_s"] = tokens / max(elapsed, 1e-9)
        if self.stream is not None:  # this process's wait for the producer since the last log
            metrics["stream_wait_s"] = self.stream.wait_seconds - self.waited
            metrics["stream_idle_fraction"] = metrics["stream_wait_s"] / max(elapsed, 1e-9)
            self.waited = self.stream.wait_seconds
        self.started = time.perf_counter()
        self.last_metrics = metrics
        self.window = MetricWindow(t.ttt_steps, finite_only=self.skip_mode)
        accelerator.log({f"train/{k}": v for k, v in metrics.items()}, step=state.step)
        if self.main:
            _write_metrics(self.run.metrics_path, {"event": "train", "step": state.step, **metrics})
            if self.progress is not None:
                post = {"loss": f"{metrics['loss']:.4f}"}
                post.update(
                    {f"acc{k}": f"{metrics[f'cond_acc_{k}']:.2f}" for k in range(t.ttt_steps)}
                )
                self.progress.set_postfix(post)

    def end_segment(self, segment) -> None:
        """A consumed stream window's shards may go once a checkpoint covers it (then
        receipts, deletes)."""
        if self.stream is None or not self.config.data.reclaim or segment.window is None:
            return
        if self.state.last_checkpoint != _checkpoint_path(self.config, self.state.step):
            self.checkpoint()
        self.stream.release(segment.window)
        self.released_through = segment.window + 1

    def end_epoch(self, epoch: int) -> None:
        """Epoch finished: validate, then record the position as the next epoch's start."""
        self.validate()
        self.state.epoch, self.state.batches_done = epoch + 1, 0
        self.checkpoint()
        self.released_through = None

    # -- the end of the run

    def finish(self) -> int:
        """Preempted: checkpoint and leave (exit 5). Otherwise the end's validation and
        checkpoint, the stream's end, the final export, the published draft; exit 0."""
        run, state, accelerator, config = self.run, self.state, self.accelerator, self.config
        if self.progress is not None:
            self.progress.close()
        if self.dog is not None:
            self.dog.stop()  # what follows: checkpoint, validation, export (the group's timeout)
        if self.preempted:
            return _leave_preempted(
                accelerator,
                run.model,
                state,
                run.scheduler,
                config,
                self.safe_to_keep,
                self.preempt,
            )
        if state.validated_step != state.step:  # stopped mid-epoch (max_steps): judge the end too
            self.safe_to_keep()
            self._validate_and_export()
        if state.last_checkpoint != _checkpoint_path(config, state.step):
            self.safe_to_keep()
            save_checkpoint(accelerator, state, run.scheduler, config, run.model)
        if (
            self.stream is not None and self.main
        ):  # after the last checkpoint: what it covers may go
            self.stream.finish(self.released_through)
        self.safe_to_keep()
        final_export = export_draft(
            accelerator, run.model, run.inputs, run.arch, state, self.last_metrics
        )
        self.publish_and_record(final_export)
        # Tear down together, with no engine left: a rank that left early, its DeepSpeed engine
        # and gloo work objects still alive, aborted at interpreter exit ("terminate called
        # without an active exception", about 1 in 4 two-process ZeRO-3 runs).
        accelerator.free_memory()
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return 0

    def publish_and_record(self, final_export: Path | None) -> None:
        """The best export (else the final one) copied to OUTPUT/draft, and the "done" event
        with the corrupt samples left out on every rank and the stream's totals."""
        config, state, accelerator = self.config, self.state, self.accelerator
        corrupt_all = self.corrupt_total
        if config.data.verify_rows and config.data.on_corrupt == "skip" and self.world > 1:
            total = torch.tensor([float(self.corrupt_total)], device=accelerator.device)
            corrupt_all = int(accelerator.reduce(total, reduction="sum").item())
        if not self.main:
            return
        chosen = Path(state.best_export) if state.best_export else final_export
        assert chosen is not None
        published = publish(chosen, Path(config.output_dir))
        _write_metrics(
            self.run.metrics_path,
            {
                "event": "done",
                "step": state.step,
                "draft": str(published),
                "best_step": state.best_step,
                **({"corrupt_samples": corrupt_all} if corrupt_all else {}),
                **(
                    _stream_totals(self.stream, self.run.started) if self.stream is not None else {}
                ),
            },
        )
        log.info("done: %d steps; draft at %s (from %s)", state.step, published, chosen)


def _leave_preempted(accelerator, model, state, scheduler, config, safe_to_keep, preempt) -> int:
    """A preemption signal: checkpoint at this step boundary (unless one is there), leave
    together with exit 5. The rerun resumes from it exactly."""
    safe_to_keep()
    if state.last_checkpoint != _checkpoint_path(config, state.step):
        save_checkpoint(accelerator, state, scheduler, config, model)
    message = (
        f"preempted by {preempt.describe()} (rank {accelerator.process_index}): stopped at "
        f"step {state.step} with checkpoint {state.last_checkpoint}; rerun the same command "
        "to resume"
    )
    if accelerator.is_main_process:
        path = Path(config.output_dir) / "metrics.jsonl"
        _write_metrics(path, {"event": "preempted", "step": state.step, "message": message})
    log.warning("%s", message)
    accelerator.free_memory()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return EXIT_PREEMPTED


def _stream_totals(stream: StreamWindows, started: float) -> dict[str, float]:
    seconds = time.perf_counter() - started
    return {
        "stream_wait_s": round(stream.wait_seconds, 3),
        "stream_idle_fraction": round(stream.wait_seconds / max(seconds, 1e-9), 4),
        "stream_freed_bytes": stream.freed_bytes,
        "seconds": round(seconds, 3),
    }


def _validate_and_export(
    accelerator, model, inputs, arch, val_idx, state, config, metrics_path, last_metrics
) -> None:
    state.validated_step = state.step
    val = evaluate(accelerator, model, inputs, val_idx, config) if len(val_idx) else None
    if val is None:
        return
    accelerator.log(val, step=state.step)
    if accelerator.is_main_process:
        _write_metrics(metrics_path, {"event": "validation", "step": state.step, **val})
        log.info("validation at step %d: %s", state.step, {k: round(v, 4) for k, v in val.items()})
    value = val.get(config.train.best_metric)
    if value is None:
        raise KeyError(f"train.best_metric {config.train.best_metric!r} not among {sorted(val)}")
    if _better(value, state.best_value, config.train.best_mode):
        path = export_draft(accelerator, model, inputs, arch, state, {**last_metrics, **val})
        state.best_value, state.best_step = value, state.step
        state.best_export = str(path) if path is not None else state.best_export


def _agree_on_failure(accelerator, failed: bool) -> bool:
    """True on every rank when any rank failed (one small all-reduce)."""
    if accelerator.num_processes == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)


def _stop_nan(accelerator, where: BadStep, last_checkpoint: str | None, metrics_path: Path) -> None:
    ids = where.sample_ids
    message = (
        f"{where.what} is not finite ({float(where.value)}) at step {where.step} (epoch "
        f"{where.epoch}, batch {where.batch} of rank {accelerator.process_index}; samples "
        f"{ids[:5]}{'...' if len(ids) > 5 else ''}). Stopping "
        f"without saving; last good checkpoint: {last_checkpoint or 'none yet'}. "
        "Lower train.lr or check the inputs (eagle3-schemas validate), then resume from it."
    )
    if accelerator.is_main_process:
        _write_metrics(metrics_path, {"event": "nan", "step": where.step, "message": message})
    log.error("%s", message)
    raise TrainingStopped(message)
