"""Validation: the held-out batches' metrics at the eval points, and the best draft so far
exported (train.best_metric, train.best_mode)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from eagle3_train.components.checkpoint import TrainerState
from eagle3_train.components.metrics import MetricWindow, note_corrupt, write_metrics
from eagle3_train.config.run_config import Config
from eagle3_train.data.batch import forward, verify_mode
from eagle3_train.data.dataset import plan_epoch, rank_batches
from eagle3_train.data.inputs import RunInputs
from eagle3_train.data.loader import make_loader
from eagle3_train.run.deliver import Delivery

log = logging.getLogger(__name__)


class Validation:
    """Validates the model being trained on the order's validation samples; a better value
    of the best metric exports the draft (every rank takes part, the main one writes)."""

    def __init__(self, delivery: Delivery, val_idx, metrics_path: Path) -> None:
        self.delivery = delivery
        self.val_idx = val_idx
        self.metrics_path = metrics_path

    def run(self, state: TrainerState, last_metrics: dict[str, float]) -> None:
        d = self.delivery
        accelerator, config = d.accelerator, d.inputs.config
        state.validated_step = state.step
        val = None
        if len(self.val_idx):
            val = evaluate(accelerator, d.model, d.inputs, self.val_idx, config)
        if val is None:
            return
        accelerator.log(val, step=state.step)
        if accelerator.is_main_process:
            write_metrics(self.metrics_path, {"event": "validation", "step": state.step, **val})
            rounded = {k: round(v, 4) for k, v in val.items()}
            log.info("validation at step %d: %s", state.step, rounded)
        t = config.train
        value = val.get(t.best_metric)
        if value is None:
            raise KeyError(f"train.best_metric {t.best_metric!r} not among {sorted(val)}")
        if better(value, state.best_value, t.best_mode):
            path = d.export(state, {**last_metrics, **val})
            state.best_value, state.best_step = value, state.step
            state.best_export = str(path) if path is not None else state.best_export


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
        for batch in make_loader(ds, plan, 0, recycle=True, verify=verify_mode(config)):
            loss, stats = forward(model, batch, accelerator, config)
            window.add(loss, stats, int(batch["input_ids"].shape[0]))
            window.corrupt += note_corrupt(batch, -1, accelerator.process_index, None)
    model.train()
    metrics, _ = window.reduce(accelerator)
    return {f"val/{k}": v for k, v in metrics.items()}


def better(value: float, best: float | None, mode: str) -> bool:
    if math.isnan(value):
        return False
    return best is None or (value < best if mode == "min" else value > best)
