"""A run's set-up: its inputs checked (preflight), its output directory prepared, and the
pieces the loop composes — model, optimizer, schedule, data order, resumed state, trackers."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_schemas.contract.stream import CONSUMER_STOPPED
from eagle3_schemas.io.jsonl import truncate_torn_tail
from eagle3_train.components import zero_clip
from eagle3_train.components.accelerator import agree_on_failure
from eagle3_train.components.build import build_model, lr_lambda, make_optimizer, speed_up
from eagle3_train.components.checkpoint import RUN_CONFIG_FILE, Checkpoints, TrainerState
from eagle3_train.components.faults import EXIT_PREFLIGHT
from eagle3_train.components.metrics import write_metrics
from eagle3_train.config.run_config import Config, dump_config
from eagle3_train.data.inputs import RunInputs, checkpoint_lineage, load_inputs, resolve_arch
from eagle3_train.data.order import FinishedWindows, GlobalOrder, Packing, WindowOrder
from eagle3_train.data.stream import StreamWindows
from eagle3_train.model.arch import DraftArch
from eagle3_train.preflight import PreflightError, run_preflight

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What a run is made of once set up: the pieces the loop composes."""

    accelerator: Any
    inputs: RunInputs  # the config travels here, once: ``run.config``
    arch: DraftArch
    model: Any  # prepared by Accelerate
    optimizer: Any
    scheduler: Any
    order: GlobalOrder | WindowOrder
    state: TrainerState
    checkpoints: Checkpoints
    total_steps: int
    metrics_path: Path
    started: float  # perf_counter at the start of train()

    @property
    def config(self) -> Config:
        return self.inputs.config

    @property
    def stream(self) -> StreamWindows | None:
        return self.inputs.stream


def load_and_check_inputs(
    config: Config, accelerator, preflight_only: bool
) -> tuple[RunInputs, DraftArch, Path | None] | int:
    """Inputs and preflight: (inputs, arch, checkpoint to resume from), or EXIT_PREFLIGHT on
    every rank within seconds when any rank found a problem."""
    main = accelerator.is_main_process
    try:
        inputs = load_inputs(config)
        arch = resolve_arch(inputs)
        resume_from = Checkpoints.of(config).find(config.train.resume)
        if config.train.preflight or preflight_only:
            report = run_preflight(inputs, arch, accelerator, resume_from, full=main)
            if main:
                log.info("%s", report.render())
            report.raise_on_errors()
    except Exception as e:  # any failure here (even a crash in the dry run) stops every rank
        detail = str(e) if isinstance(e, PreflightError) else f"{type(e).__name__}: {e}"
        log.error("preflight failed (rank %d):\n%s", accelerator.process_index, detail)
        agree_on_failure(accelerator, True)
        return EXIT_PREFLIGHT
    if agree_on_failure(accelerator, False):
        return EXIT_PREFLIGHT
    return inputs, arch, resume_from


def metrics_file(config: Config) -> Path:
    return Path(config.output_dir) / "metrics.jsonl"


def prepare_output_dir(config: Config, accelerator) -> None:
    """run.yaml written, temporary checkpoints of a killed save and a metrics line torn by a
    kill or a full disk removed (main process)."""
    out_dir = Path(config.output_dir)
    if accelerator.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / RUN_CONFIG_FILE).write_text(dump_config(config), encoding="utf-8")
        Checkpoints.of(config).remove_partial()
        truncate_torn_tail(metrics_file(config))
    accelerator.wait_for_everyone()


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


def set_up_run(
    accelerator, inputs: RunInputs, arch: DraftArch, resume_from: Path | None, started: float
) -> Run | None:
    """Model, optimizer, data order, schedule, the resumed state and the trackers; None when
    no optimizer step fits the data (logged)."""
    config = inputs.config
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
    if t.optimizer == "muon" and t.max_grad_norm > 0 and accelerator.state.deepspeed_plugin:
        # the clip before Newton–Schulz, on this run's ZeRO-2 optimizer only (zero_clip.py)
        zero_clip.install(optimizer.optimizer, t.max_grad_norm)

    checkpoints = Checkpoints.of(config)
    state = TrainerState(world_size=world, lineage=checkpoint_lineage(inputs) if main else {})
    if resume_from is not None:
        state = checkpoints.load(accelerator, resume_from, scheduler)
        log.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            resume_from,
            state.step,
            state.epoch,
            state.batches_done,
        )
    start_trackers(accelerator, config)
    metrics_path = metrics_file(config)
    if main:
        write_metrics(
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
        accelerator,
        inputs,
        arch,
        model,
        optimizer,
        scheduler,
        order,
        state,
        checkpoints,
        total_steps,
        metrics_path,
        started,
    )


def start_trackers(accelerator, config: Config) -> None:
    """The trackers (train.trackers) with the config as hyperparameters."""
    # TensorBoard's hparams take scalars and strings only
    flat = {
        f"{section}.{k}": (v if isinstance(v, int | float | str | bool) else json.dumps(v))
        for section, values in config.to_dict().items()
        if isinstance(values, dict)
        for k, v in values.items()
    }
    accelerator.init_trackers(config.train.project_name, config=flat)
