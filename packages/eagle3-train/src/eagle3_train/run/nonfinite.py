"""Non-finite losses and gradient norms, found without a host sync per step.

train.on_non_finite: stop (NonFiniteWatch) ends the run at the first one; skip
(NonFiniteSkip) leaves the optimizer step out and ends the run after
train.max_skips_in_row such steps in a row. Nothing of a bad step is ever saved: whatever is
kept first drains every pending verdict.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_train.components.faults import TrainingStopped
from eagle3_train.components.metrics import write_metrics

log = logging.getLogger(__name__)


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
        self.pending.append((*host_copy(bad), where))
        self.drain(metrics_path, last, keep=self.lag)

    def drain(self, metrics_path: Path, last_checkpoint: str | None, keep: int = 0) -> None:
        while len(self.pending) > keep:
            host, event, where = self.pending.pop(0)
            if event is not None:
                event.synchronize()
            if float(host[0]) > 0:
                stop_nan(self.accelerator, where, last_checkpoint, metrics_path)

    def step_optimizer(self, optimizer) -> None:
        optimizer.step()

    def end_step(self, metrics_path: Path, last_checkpoint: str | None) -> None:
        """(stop mode: every verdict was queued by ``record``)"""


def host_copy(flags: torch.Tensor) -> tuple[torch.Tensor, Any]:
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
        host, event = host_copy(self.flags)
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
            write_metrics(metrics_path, record)

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
            write_metrics(
                metrics_path, {"event": "nan", "step": wheres[0].step, "message": message}
            )
        log.error("%s", message)
        raise TrainingStopped(message)


def stop_nan(accelerator, where: BadStep, last_checkpoint: str | None, metrics_path: Path) -> None:
    ids = where.sample_ids
    message = (
        f"{where.what} is not finite ({float(where.value)}) at step {where.step} (epoch "
        f"{where.epoch}, batch {where.batch} of rank {accelerator.process_index}; samples "
        f"{ids[:5]}{'...' if len(ids) > 5 else ''}). Stopping "
        f"without saving; last good checkpoint: {last_checkpoint or 'none yet'}. "
        "Lower train.lr or check the inputs (eagle3-schemas validate), then resume from it."
    )
    if accelerator.is_main_process:
        write_metrics(metrics_path, {"event": "nan", "step": where.step, "message": message})
    log.error("%s", message)
    raise TrainingStopped(message)
