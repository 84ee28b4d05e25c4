"""A crash during an atomic write never leaves a file that looks whole."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from eagle3_schemas import atomic_directory, atomic_path, validate
from eagle3_schemas.io.atomic import TEMP_MARKER

from support.fixtures import build


def test_exception_inside_the_block_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "out.bin"
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def test_exception_inside_a_directory_block_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "dataset") as tmp:
        build("eval_report", tmp)
        raise RuntimeError("crash")
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_refuses_to_overwrite(tmp_path: Path) -> None:
    (tmp_path / "dataset").mkdir()
    with (
        pytest.raises(FileExistsError, match="refusing to overwrite"),
        atomic_directory(tmp_path / "dataset"),
    ):
        pass


WRITER = textwrap.dedent(
    """
    import sys
    import numpy as np
    from eagle3_schemas.contract.header import make_header, write_safetensors
    header = make_header("vocab_map", {"tokenized_fingerprint": "x", "tokenizer_fingerprint": "y"},
                         draft_vocab_size=4, target_vocab_size=50_000_000, num_loss_tokens=0, coverage=0.0)
    counts = np.zeros(50_000_000, np.int64)  # 400 MB: the kill lands mid-write
    t2d = np.zeros(50_000_000, bool)
    t2d[:4] = True
    print("writing", flush=True)
    write_safetensors(sys.argv[1], {"token_counts": counts, "d2t": np.zeros(4, np.int64), "t2d": t2d}, header)
    print("done", flush=True)
    """
)


@pytest.mark.process
def test_kill_9_during_a_write_leaves_no_file_that_validates(tmp_path: Path) -> None:
    final = tmp_path / "vocab_map.safetensors"
    command = [sys.executable, "-c", WRITER, str(final)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "writing"
        time.sleep(0.3)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert not final.exists(), "a killed writer left a file under the final name"
    leftovers = list(tmp_path.iterdir())
    assert leftovers, "the kill landed before the write began"
    assert any(TEMP_MARKER in p.name for p in leftovers), leftovers
    for p in (
        leftovers
    ):  # a leftover temp file (ours, or safetensors' own) is never taken for an artifact
        assert validate(p), p
