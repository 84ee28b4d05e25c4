"""A step saved twice (an epoch's end at a save step): the later save replaces the earlier one.

It used to remove the earlier checkpoint, then rename the new one into place: a kill between the
two left ``latest.json`` naming a step with no checkpoint (the run restarted from step 0), and a
kill inside the removal left a directory that still looked like a checkpoint but lacked files
(every resume then failed loading it). Now the earlier save is renamed aside and removed only
once the new one has its name, and a resume falls back to it. The new one's files are flushed to
disk before it is named.
"""

from __future__ import annotations

import errno
import io
import os
import shutil
from pathlib import Path

import accelerate.checkpointing
import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from eagle3_schemas.io.diskspace import DiskFull
from eagle3_train.components.checkpoint import Checkpoints, TrainerState, read_state

from support.iofaults import count_calls, failing


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

    rename, rmtree = os.rename, shutil.rmtree

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


def _through_os_write(obj: object, f: object, *args: object, **kwargs: object) -> None:
    """accelerate's ``save`` and ``torch.save`` as a stand-in that writes the same bytes with
    ``os.write`` in chunks, so support.iofaults counts (and fails) each of them."""
    buffer = io.BytesIO()
    _torch_save(obj, buffer)
    fd = os.open(str(f), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = buffer.getvalue()
        for start in range(0, len(data), 4096):
            os.write(fd, data[start : start + 4096])
    finally:
        os.close(fd)


_torch_save = torch.save


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_every_fault_while_a_step_s_save_is_replaced_keeps_a_whole_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """``accelerator.save_state`` (model, optimizer, RNG), the flush, the renames and the
    pointer fail in turn at their k-th write, fsync or rename: a whole checkpoint of the step is
    always there to resume from, and the same save run again completes."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(cpu=True)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        first = tmp_path / "first"
        Checkpoints(first, keep=2).save(accelerator, TrainerState(step=4), scheduler)
        whole = sorted(p.name for p in (first / "checkpoints" / "step-00000004").iterdir())
        monkeypatch.setattr(accelerate.checkpointing, "save", _through_os_write)
        monkeypatch.setattr(torch, "save", _through_os_write)
        state = TrainerState(step=4, epoch=1)

        def replace(root: Path) -> None:
            Checkpoints(root, keep=2).save(accelerator, state, scheduler)

        shutil.copytree(first, tmp_path / "count")
        n = count_calls(lambda: replace(tmp_path / "count"), monkeypatch)
        assert n >= 8, n
        for k in range(n):
            root = tmp_path / f"k{k}"
            shutil.copytree(first, root)
            with failing(monkeypatch, k, code) as seen, pytest.raises((OSError, DiskFull)):
                replace(root)
            found = Checkpoints(root, keep=2).find("auto")
            assert found is not None, seen
            assert sorted(p.name for p in found.iterdir()) == whole, (seen, found)
            replace(root)  # the rerun's save of that step
            assert read_state(Checkpoints(root, keep=2).find("auto"))["epoch"] == 1
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
