"""Fault injection into the shard writer (``save_safetensors``: serialized by hand, each tensor's
bytes written on a second thread through a bounded queue): its k-th write, fsync or rename fails
with ENOSPC or EIO, for every k. Each failure raises an error naming the shard (DiskFull for a
full disk) instead of hanging, and leaves the old shard whole or none, and no temporary file.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eagle3_extract.writer as writer
from eagle3_schemas.io.diskspace import DiskFull

from support.iofaults import count_calls, failing, leftovers

# more tensors than the writer's queue holds: a writer thread that stopped at a failed write
# must not leave the packer blocked on a full queue
TENSORS = 20


def _tensors(version: int) -> dict[str, torch.Tensor]:
    return {f"t{i:02d}": torch.full((3, 4), float(version * 100 + i)) for i in range(TENSORS)}


def _save(path: Path, version: int) -> None:
    writer.save_safetensors(path, _tensors(version))


def _bounded(call: Callable[[], object], seconds: float = 30.0) -> BaseException | None:
    """Run ``call`` on a thread; its exception (None: none); fail if it has not returned."""
    result: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call()
        except BaseException as e:  # handed to the test
            result[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the shard writer hung after a failed write"
    return result[0]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_every_fault_names_the_shard_and_leaves_the_old_one_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    probe = tmp_path / "probe.safetensors"
    n = count_calls(lambda: _save(probe, 1), monkeypatch, (writer,))
    assert n >= TENSORS + 3, n  # the header, each tensor, the fsync, the rename, the folder's
    for k in range(n):
        for old in (0, None):
            folder = tmp_path / f"{k}-{old}"
            folder.mkdir()
            path = folder / "shard.safetensors"
            if old is not None:
                _save(path, old)
            with failing(monkeypatch, k, code, (writer,)) as seen:
                error = _bounded(lambda path=path: _save(path, 1))
            if code == errno.ENOSPC:
                assert isinstance(error, DiskFull), (seen, error)
                assert f"{path}: no room for this file" in str(error)
            else:
                assert isinstance(error, OSError) and error.errno == code, (seen, error)
                assert error.filename == str(path)
            renamed = "replace" in seen[:-1]  # the fault hit the folder's fsync, after it
            if renamed:
                expected = _tensors(1)
            elif old is None:
                assert not path.exists(), seen
                expected = None
            else:
                expected = _tensors(old)
            if expected is not None:
                got = load_file(path)
                assert sorted(got) == sorted(expected) and all(
                    torch.equal(got[name], expected[name]) for name in got
                ), seen
            assert not leftovers(folder), seen
