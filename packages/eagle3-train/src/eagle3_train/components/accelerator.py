"""The Accelerator a run trains under (GPU or CPU, plain, DDP or DeepSpeed), this process's
torch threads, and the one small collective by which every rank agrees that one failed."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from eagle3_train.config.run_config import Config
from eagle3_train.config.train_config import TrainLoopConfig

log = logging.getLogger(__name__)


def is_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


@dataclass(frozen=True)
class ZeroLaunch:
    """What the DeepSpeed launch runs, as Accelerate's DeepSpeedPlugin reads it: the
    ``accelerate launch`` environment, or the deepspeed_config_file it names."""

    stage: int
    offload_optimizer: str  # "none", "cpu" or "nvme"

    @classmethod
    def from_environment(cls) -> ZeroLaunch:
        stage = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))  # Accelerate's default
        offload = os.environ.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        if path != "none":
            zero = json.loads(Path(path).read_text()).get("zero_optimization", {})
            stage = int(zero["stage"]) if zero.get("stage", "auto") != "auto" else stage
            offload = zero.get("offload_optimizer", {}).get("device", offload)
        return cls(stage, str(offload or "none"))


MUON_CHECKED = "tests/test_muon_zero.py checks DeepSpeed's Muon equal to torch's under ZeRO-2 only"

# Settings DeepSpeed cannot run, each with why: refused before anything starts.
DEEPSPEED_REFUSED: list[tuple[str, Callable[[TrainLoopConfig, ZeroLaunch], bool], str]] = [
    (
        "train.on_non_finite: skip",
        lambda t, z: t.on_non_finite == "skip",
        "its engine steps the optimizer inside backward, before the step's verdict is known; "
        "use stop",
    ),
    (
        "train.optimizer: muon under ZeRO stage 1 or 3",
        lambda t, z: t.optimizer == "muon" and z.stage != 2,
        f"{MUON_CHECKED}: stage 3 orthogonalises in its own sub-group loop (zero/stage3.py, one "
        "momentum for every Muon group) and stage 1 of bf16 weights steps in bf16_optimizer.py, "
        "neither compared; use a ZeRO-2 config (recipes/accelerate/zero2.yaml)",
    ),
    (
        "train.optimizer: muon with offload_optimizer",
        lambda t, z: t.optimizer == "muon" and z.offload_optimizer != "none",
        f"{MUON_CHECKED}: ZeRO-Offload orthogonalises on another path "
        "(stage_1_and_2.py _apply_muon_updates_cpu_offload), not compared; use zero2.yaml",
    ),
    (
        "train.optimizer: muon with train.muon.ns_steps other than 5",
        lambda t, z: t.optimizer == "muon" and t.muon.ns_steps != 5,
        "ZeRO calls DeepSpeed's muon_update without ns_steps, which then runs 5",
    ),
    (
        "train.optimizer: muon with train.muon.newton_schulz_dtype: float32",
        lambda t, z: t.optimizer == "muon" and t.muon.newton_schulz_dtype == "float32",
        "DeepSpeed's muon_update iterates Newton–Schulz in bf16 only",
    ),
]


def deepspeed_refusals(config: Config) -> list[str]:
    """What of ``config`` DeepSpeed cannot run (one message each), under a DeepSpeed launch."""
    if not is_deepspeed():
        return []
    launch = ZeroLaunch.from_environment()
    return [
        f"{setting} is not available under DeepSpeed ({why})"
        for setting, chosen, why in DEEPSPEED_REFUSED
        if chosen(config.train, launch)
    ]


def available_trackers(names: list[str]) -> list[str]:
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
    deepspeed = is_deepspeed()
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
        set_deepspeed_config(plugin.deepspeed_config, t)
    return accelerator


def set_deepspeed_config(ds: dict[str, Any], t: TrainLoopConfig) -> None:
    """What eagle3-train sets in the DeepSpeed config Accelerate hands the engine."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    ds["train_micro_batch_size_per_gpu"] = 1  # one packed sequence per micro-batch
    ds["gradient_accumulation_steps"] = t.gradient_accumulation_steps
    # Muon clips before Newton–Schulz (components/zero_clip.py, installed by run/setup.py):
    # DeepSpeed's own clip would clip the orthogonalised update, after it
    ds["gradient_clipping"] = 0.0 if t.optimizer == "muon" else t.max_grad_norm
    zero = ds.setdefault("zero_optimization", {})
    zero["stage3_gather_16bit_weights_on_model_save"] = True  # exports gather on rank 0
    if t.optimizer == "muon" and "compute_grad_norm" in DeepSpeedZeroConfig.model_fields:
        # Its norm would be the orthogonalised updates' (one more pass over every gradient
        # partition per step), which nothing reads: zero_clip computes and reports the
        # gradients' own, and a non-finite one stops the run (train.on_non_finite: stop, the
        # only choice under DeepSpeed). fp16's overflow check runs apart from it. Older DeepSpeeds
        # (pyproject allows 0.17) lack the switch and refuse unknown keys.
        zero["compute_grad_norm"] = False


def cpu_threads(configured: int | None, accelerator: Any) -> int:
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


def start_accelerator(config: Config, preflight_only: bool):
    """The Accelerator, this process's torch threads and (CUDA) matmul precision."""
    t = config.train
    accelerator = make_accelerator(config, with_trackers=not preflight_only)
    torch.set_num_threads(cpu_threads(t.torch_threads, accelerator))
    if accelerator.device.type == "cuda":
        torch.set_float32_matmul_precision("high" if t.tf32 else "highest")
    return accelerator


def agree_on_failure(accelerator, failed: bool) -> bool:
    """True on every rank when any rank failed (one small all-reduce)."""
    if accelerator.num_processes == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction="sum").item() > 0)
