"""Preemption: SIGTERM (or a configured signal) seals the shard in flight and stops with exit 5;
a disk that fills up stops with exit 7 naming the shard, its size and what is free. Either
way nothing torn is left, nothing sealed is redone, the rerun completes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_extract.config import ConfigError, ExtractConfig
from eagle3_extract.run import run
from eagle3_extract.workdir import WorkDir, partial_dir
from eagle3_schemas import validate
from eagle3_schemas.contract.stream import Fragment
from eagle3_schemas.io.atomic import TEMP_MARKER

from support import fixtures

LENGTHS = tuple(3 + (7 * i) % 23 for i in range(40))


@contextmanager
def extraction_under_way(
    model: Path, tokenized: Path, out: Path, log: Path, stdout: int
) -> Iterator[subprocess.Popen[bytes]]:
    """``eagle3-extract run`` in its own interpreter with the smallest shards (stderr into ``log``),
    handed over once three shards are sealed; killed on the way out."""
    work = WorkDir(out)
    command = [sys.executable, "-m", "eagle3_extract", "run", "--model", str(model)]
    command += ["--tokenized", str(tokenized), "--out", str(out), "--shard-mb", "1e-6"]
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(command, stdout=stdout, stderr=stderr)
    try:
        deadline = time.monotonic() + 120
        while not work.fragments_dir.exists() or len(list(work.fragments_dir.iterdir())) < 3:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "extraction did not start"
            time.sleep(0.001)
        yield proc
    finally:
        proc.kill()


@pytest.mark.process
def test_sigterm_seals_the_shard_in_flight_and_the_rerun_resumes(
    llama_target: Path, tmp_path: Path
) -> None:
    sig = "SIGTERM"
    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=LENGTHS)
    out = tmp_path / "ds"
    work = WorkDir(out)
    log = tmp_path / "run.log"
    with extraction_under_way(llama_target, tokenized, out, log, subprocess.PIPE) as proc:
        proc.send_signal(getattr(signal, sig))
        stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5, log.read_text()[-3000:]
    summary = json.loads(stdout)
    assert summary["status"] == "preempted" and summary["signal"] == sig
    sealed = summary["shards_sealed"]
    assert 3 <= sealed < len(LENGTHS)
    shards = sorted(p.name for p in (work.root / "shards").iterdir())
    assert not [s for s in shards if TEMP_MARKER in s], "a torn shard was left"
    assert len(shards) == len(list(work.fragments_dir.glob("*.json"))) == sealed
    assert f"preempted by {sig}" in log.read_text()
    assert not out.exists()

    again = run(ExtractConfig(model=llama_target, tokenized=tokenized, out=out, shard_mb=1e-6))
    assert again["status"] == "complete"
    # every sealed shard kept, none redone
    assert again["tokens_this_attempt"] == sum(LENGTHS) - summary["tokens_this_attempt"]
    assert validate(out) == [] and not partial_dir(out).exists()
    ids = pq.read_table(out / "manifest.parquet").column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)) == len(LENGTHS)


def test_an_unknown_preempt_signal_is_refused(llama_target: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'SIGNOPE' is not a signal name"):
        ExtractConfig(
            model=llama_target, tokenized=tmp_path, out=tmp_path / "o", preempt_signals=("SIGNOPE",)
        )


@pytest.mark.tmpfs
def test_a_disk_that_fills_up_stops_naming_the_shard_and_the_rerun_resumes(
    llama_target: Path, tmp_path: Path
) -> None:
    """On a real 8 MiB tmpfs that something else fills while the run goes (preflight saw room):
    the run stops (exit 7) with what the next shard needs and what is free, every sealed shard
    kept, no temporary file; once space is freed the same command finishes without redoing a
    sealed shard."""
    from support.smallfs import leave_free, small_tmpfs

    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=LENGTHS)
    with small_tmpfs(tmp_path / "small") as disk:
        out = disk / "ds"
        work = WorkDir(out)
        log = tmp_path / "run.log"
        with extraction_under_way(llama_target, tokenized, out, log, subprocess.DEVNULL) as proc:
            filler = leave_free(disk, 64 << 10)  # another job fills the disk
            code = proc.wait(timeout=120)
        text = log.read_text()
        assert code == 7, text[-3000:]
        assert f"{work.root / 'shards'}: no room for shard" in text
        assert "needs about" in text and "free on that filesystem" in text
        shards = [p.name for p in (work.root / "shards").iterdir()]
        assert not [s for s in shards if TEMP_MARKER in s]
        fragments = [
            Fragment.from_json(json.loads(p.read_text())) for p in work.fragments_dir.glob("*.json")
        ]
        assert 3 <= len(fragments) == len(shards) < len(LENGTHS) and not out.exists()
        sealed_tokens = sum(r.num_tokens for f in fragments for r in f.rows)
        filler.unlink()
        again = run(ExtractConfig(model=llama_target, tokenized=tokenized, out=out, shard_mb=1e-6))
        assert again["status"] == "complete" and validate(out) == []
        # every sealed shard kept, none redone: exactly the tokens of the unsealed ones
        assert again["tokens_this_attempt"] == sum(LENGTHS) - sealed_tokens
