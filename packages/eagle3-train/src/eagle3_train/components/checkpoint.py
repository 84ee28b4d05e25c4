"""Checkpoints: the only code that knows their layout under ``OUTPUT/checkpoints``.

step-N/        resumable state: model, optimizer, RNG (accelerate.save_state) and
               trainer_state.json (step, data position, scheduler, best); written as
               .tmp-step-N, flushed to disk and renamed when complete
.old-step-N/   the earlier save of step N while a later save of the same step (an epoch's end
               at a save step) takes its name; resumed from when a kill fell between the renames
latest.json    the newest complete checkpoint
../run.yaml    the resolved config of the run that wrote them
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from eagle3_schemas.io.atomic import fsync_dir, fsync_tree, write_json_atomic
from eagle3_schemas.io.diskspace import DiskFull, check_free, disk_full, is_disk_full
from eagle3_train.components.accelerator import agree_on_failure
from eagle3_train.config.run_config import Config

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest.json"
OLD = ".old-"  # the prefix of a step's earlier save while a later one replaces it
RUN_CONFIG_FILE = "run.yaml"  # in the output directory, beside checkpoints/


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


class Checkpoints:
    """The checkpoints of the run in ``output_dir``: the path of a step, the latest, a
    checkpoint's state, saving (atomic, free space checked, ``keep`` newest kept) and loading."""

    def __init__(self, output_dir: str | Path, keep: int) -> None:
        self.root = Path(output_dir) / "checkpoints"
        self.keep = keep

    @classmethod
    def of(cls, config: Config) -> Checkpoints:
        """The checkpoints of the run ``config`` describes (train.keep_checkpoints kept)."""
        return cls(config.output_dir, config.train.keep_checkpoints)

    def path(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def saved_at_step(self, state: TrainerState) -> bool:
        """The last checkpoint is of this very step."""
        return state.last_checkpoint == str(self.path(state.step))

    def latest(self) -> Path | None:
        """The checkpoint ``latest.json`` points at (complete or not), None without one."""
        pointer = self.root / LATEST_FILE
        if not pointer.is_file():
            return None
        return self.root / json.loads(pointer.read_text(encoding="utf-8"))["path"]

    def find(self, resume: str) -> Path | None:
        """The checkpoint train.resume names: ``never`` none, ``auto`` the latest complete
        one (if any), else the path given, which must be a checkpoint."""
        if resume == "never":
            return None
        if resume != "auto":
            path = Path(resume)
            if not is_checkpoint(path):
                raise FileNotFoundError(
                    f"train.resume: {path} is not a checkpoint (no {STATE_FILE})"
                )
            return path
        path = self.latest()
        if path is None:
            return None
        if not is_checkpoint(path) and is_checkpoint(self.root / f"{OLD}{path.name}"):
            return self.root / f"{OLD}{path.name}"  # killed while replacing a save of this step
        return path if is_checkpoint(path) else None

    def remove_partial(self) -> None:
        """Temporary directories left by a killed save (main process)."""
        for stale in self.root.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    def save(self, accelerator, state: TrainerState, scheduler, model=None) -> Path:
        """Resumable state, written under a temporary name and renamed when every rank is done.
        Free space for it is checked first (DiskFull, nothing written); a write that still hits
        a full disk removes the temporary directory and raises DiskFull naming path and sizes."""
        final = self.path(state.step)
        root, name = self.root, final.name
        tmp = root / f".tmp-{name}"
        needed = checkpoint_bytes(model, state.last_checkpoint) if model is not None else 0
        problem = None
        if accelerator.is_main_process:
            root.mkdir(parents=True, exist_ok=True)
            try:
                check_free(root, f"checkpoint {name}", needed)
            except DiskFull as e:
                problem = e
        if agree_on_failure(accelerator, problem is not None):
            raise problem or DiskFull(f"{root}: rank 0 found no room for checkpoint {name}")
        previous = state.last_checkpoint
        state.last_checkpoint = str(final)  # on every rank: later decisions must agree
        try:
            if accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            accelerator.wait_for_everyone()
            accelerator.save_state(str(tmp))
            accelerator.wait_for_everyone()
            if accelerator.is_main_process:
                state.scheduler = scheduler.state_dict()
                # (without trainer_state.json the directory is no checkpoint)
                write_json_atomic(tmp / STATE_FILE, state.to_json())
        except Exception as e:  # OSError, or safetensors' SafetensorError
            if not is_disk_full(e):
                raise
            state.last_checkpoint = previous
            shutil.rmtree(tmp, ignore_errors=True)
            raise disk_full(tmp, f"checkpoint {name}", needed or None, e) from e
        if accelerator.is_main_process:
            fsync_tree(tmp)  # accelerate's writers do not flush: on disk before it is named
            old = root / f"{OLD}{name}"
            if final.exists():  # the same step saved twice (epoch end == save step): the
                shutil.rmtree(old, ignore_errors=True)  # earlier save stays whole until the
                os.rename(final, old)  # new one has its name (find falls back to it)
            os.rename(tmp, final)
            fsync_dir(root)
            write_json_atomic(root / LATEST_FILE, {"path": name, "step": state.step})
            for stale in root.glob(f"{OLD}*"):
                shutil.rmtree(stale, ignore_errors=True)
            kept = sorted(p for p in root.glob("step-*") if p.is_dir())
            for expired in kept[: max(0, len(kept) - self.keep)]:
                shutil.rmtree(expired, ignore_errors=True)
            log.info("checkpoint saved: %s (step %d)", final, state.step)
        accelerator.wait_for_everyone()
        return final

    def load(self, accelerator, path: Path, scheduler) -> TrainerState:
        state = TrainerState(**read_state(path))
        if state.world_size != accelerator.num_processes:
            raise RuntimeError(
                f"{path}: saved with {state.world_size} processes but this run has "
                f"{accelerator.num_processes}; the data position is per rank — resume with the "
                "same number of processes"
            )
        accelerator.load_state(str(path))
        scheduler.load_state_dict(state.scheduler)
        return state


def is_checkpoint(path: Path) -> bool:
    return (path / STATE_FILE).is_file()


def read_state(path: Path) -> dict[str, Any]:
    """A checkpoint's trainer_state.json."""
    return json.loads((path / STATE_FILE).read_text(encoding="utf-8"))


def read_run_config(path: Path) -> dict[str, Any] | None:
    """The resolved config (run.yaml) of the run that wrote checkpoint ``path``, if kept."""
    run_yaml = run_config_path(path)
    if not run_yaml.is_file():
        return None
    return yaml.safe_load(run_yaml.read_text(encoding="utf-8"))


def run_config_path(path: Path) -> Path:
    return path.parent.parent / RUN_CONFIG_FILE


def checkpoint_bytes(model, last: str | None) -> int:
    """What the next checkpoint needs: the last one's size, else the weights and AdamW's two
    moments in float32 (plus 32 KiB for RNG, scheduler and state files)."""
    if last and Path(last).is_dir():
        return sum(f.stat().st_size for f in Path(last).rglob("*") if f.is_file())
    weights = sum(p.numel() * 4 for p in model.parameters())
    moments = sum(p.numel() * 8 for p in model.parameters() if p.requires_grad)
    return weights + moments + (32 << 10)
