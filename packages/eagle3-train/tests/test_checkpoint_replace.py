"""A step saved twice (an epoch's end at a save step): the later save replaces the earlier one.

It used to remove the earlier checkpoint, then rename the new one into place: a kill between the
two left ``latest.json`` naming a step with no checkpoint (the run restarted from step 0), and a
kill inside the removal left a directory that still looked like a checkpoint but lacked files
(every resume then failed loading it). Now the earlier save is renamed aside and removed only
once the new one has its name, and a resume falls back to it. The new one's files are flushed to
disk before it is named.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from eagle3_train.components.checkpoint import Checkpoints, TrainerState, read_state


class Killed(BaseException):
    """The process dying at a chosen call (nothing after it runs)."""


@pytest.fixture
def accelerator():
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def _scheduler() -> torch.optim.lr_scheduler.LRScheduler:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@pytest.mark.parametrize("at", ["rename of the new save", "removal of the earlier save"])
def test_a_kill_while_a_step_s_save_is_replaced_resumes_from_that_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, accelerator: Accelerator, at: str
) -> None:
    checkpoints, scheduler = Checkpoints(tmp_path, keep=2), _scheduler()
    state = TrainerState(step=4, epoch=0, batches_done=4)
    checkpoints.save(accelerator, state, scheduler)
    state.epoch, state.batches_done = 1, 0  # the epoch's end, at the same step

    rename, rmtree = os.rename, __import__("shutil").rmtree

    def killed_rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if at == "rename of the new save" and Path(src).name.startswith(".tmp-"):
            raise Killed
        rename(src, dst)

    def killed_rmtree(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        doomed = Path(path).name in ("step-00000004", ".old-step-00000004")
        if at == "removal of the earlier save" and doomed and Path(path).is_dir():
            (Path(path) / "random_states_0.pkl").unlink()  # part removed, then the kill
            raise Killed
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "rename", killed_rename)
    monkeypatch.setattr("shutil.rmtree", killed_rmtree)
    with pytest.raises(Killed):
        checkpoints.save(accelerator, state, scheduler)
    monkeypatch.undo()

    found = Checkpoints(tmp_path, keep=2).find("auto")
    assert found is not None, "no checkpoint to resume from: the run would restart at step 0"
    assert read_state(found)["step"] == 4
    assert sorted(p.name for p in found.iterdir()) == sorted(
        ["random_states_0.pkl", "trainer_state.json"]
    ), "the checkpoint resumed from lacks files"
    # the next save of that step takes the name and clears the earlier one
    Checkpoints(tmp_path, keep=2).save(accelerator, state, scheduler)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest.json",
        "step-00000004",
    ]
    assert read_state(tmp_path / "checkpoints" / "step-00000004")["epoch"] == 1
