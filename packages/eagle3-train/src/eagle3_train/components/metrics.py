"""What a run records: the metric window summed on the device and reduced over ranks when
logged, and the lines of ``metrics.jsonl`` (one JSON object per event, appended whole or torn
only by a kill or a full disk: readers take complete lines, a resumed run drops the torn one)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from eagle3_schemas.io.jsonl import append_to
from eagle3_train.data.stream import StreamWindows
from eagle3_train.model.loss import NUM_STATS, summarize, unpack_stats

log = logging.getLogger(__name__)


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


def write_metrics(path: Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one line (eagle3_schemas.io.jsonl): a full disk stops the run by
    name (DiskFull, exit 7) with a torn line at most, dropped when the run resumes."""
    line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
    what = f"the {record.get('event')!r} line of step {record.get('step')}"
    append_to(path, line, what)


def note_corrupt(batch: dict[str, Any], step: int, rank: int, metrics_path: Path | None) -> int:
    """Record the samples the loader left out of ``batch`` (data.on_corrupt: skip): a warning
    and, during training, a "corrupt" event per sample from the rank that read it."""
    corrupt = batch.get("corrupt", [])
    for problem in corrupt:
        log.warning("skipped (data.on_corrupt: skip): %s", problem["message"])
        if metrics_path is not None:
            record = {k: v for k, v in problem.items() if k != "message"}
            write_metrics(metrics_path, {"event": "corrupt", "step": step, "rank": rank, **record})
    return len(corrupt)


def stream_totals(stream: StreamWindows, started: float) -> dict[str, float]:
    seconds = time.perf_counter() - started
    return {
        "stream_wait_s": round(stream.wait_seconds, 3),
        "stream_idle_fraction": round(stream.wait_seconds / max(seconds, 1e-9), 4),
        "stream_freed_bytes": stream.freed_bytes,
        "seconds": round(seconds, 3),
    }
