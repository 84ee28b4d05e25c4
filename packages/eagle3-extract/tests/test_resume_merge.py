"""Resumable after kill -9; disjoint shards on many workers; merge refuses what would corrupt."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_extract.cli import main
from eagle3_extract.config import ExtractConfig
from eagle3_extract.merge import MergeError, merge
from eagle3_extract.run import run
from eagle3_extract.samples import read_tokenized
from eagle3_extract.workdir import ResumeError, WorkDir, partial_dir
from eagle3_schemas import read_header, validate
from eagle3_schemas.io.atomic import TEMP_MARKER

from support import fixtures

LENGTHS = tuple(3 + (7 * i) % 23 for i in range(40))


def _config(model: Path, tokenized: Path, out: Path, **kwargs) -> ExtractConfig:
    # shard_mb so small that every sample gets a shard of its own: many atomic steps to kill.
    return ExtractConfig(model=model, tokenized=tokenized, out=out, shard_mb=1e-6, **kwargs)


def _fragments(work: WorkDir) -> list[Path]:
    return list(work.fragments_dir.glob("*.json")) if work.fragments_dir.exists() else []


def _assert_complete(out: Path, tokenized: Path) -> None:
    assert validate(out) == []
    ids = pq.read_table(out / "manifest.parquet").column("sample_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate samples"
    assert sorted(ids) == sorted(s.sample_id for s in read_tokenized(tokenized).samples)
    assert not partial_dir(out).exists()
    # whose answers the samples hold travels from the tokenized set to the dataset (the card)
    assert read_header(out).fields["answers"] == read_header(tokenized).fields["answers"]


@pytest.mark.process
def test_kill_9_at_a_random_point_then_rerun_completes(llama_target: Path, tmp_path: Path) -> None:
    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=LENGTHS)
    out = tmp_path / "ds"
    work = WorkDir(out)
    command = [
        sys.executable,
        "-m",
        "eagle3_extract",
        "run",
        "--model",
        str(llama_target),
        "--tokenized",
        str(tokenized),
        "--out",
        str(out),
        "--shard-mb",
        "1e-6",
    ]
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    log = tmp_path / "killed-run.log"
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        # Kill once a random number of shards is complete, after a random sub-shard delay: the
        # kill lands anywhere in a shard's capture / write / rename / fragment sequence.
        target = rng.randint(1, len(LENGTHS) - 5)
        deadline = time.monotonic() + 120
        while len(_fragments(work)) < target:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "extraction did not start"
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.01))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    done_before = len(_fragments(work))
    assert not out.exists(), f"killed run published a dataset (seed {seed})"
    assert 0 < done_before < len(LENGTHS), f"kill landed outside the run (seed {seed})"

    summary = run(_config(llama_target, tokenized, out))
    assert summary["tokens_this_attempt"] < sum(LENGTHS), "completed shards were redone"
    _assert_complete(out, tokenized)


def test_rerun_repairs_every_leftover_a_crash_can_leave(llama_target: Path, tmp_path: Path) -> None:
    """The on-disk states a kill can produce, made explicitly: a shard renamed but its fragment
    not yet written, a half-written temporary shard, a fragment whose shard was truncated."""
    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=LENGTHS[:6])
    out = tmp_path / "ds"
    # Build a partial run: run fully into a scratch dir, then take its parts apart.
    scratch = tmp_path / "scratch"
    run(_config(llama_target, tokenized, scratch))
    work = WorkDir(out)
    cfg = _config(llama_target, tokenized, out)
    from eagle3_extract.run import resolve

    ctx = resolve(cfg)
    work.prepare(ctx.identity())
    shards = sorted((scratch / "shards").glob("*.safetensors"))
    # shard 0: complete with fragment (as a finished step would leave it)
    shutil.copy(shards[0], work.root / "shards" / shards[0].name)
    frag0 = _fragment_for(scratch, shards[0].name)
    (work.fragments_dir / f"{shards[0].stem}.json").write_text(frag0)
    # shard 1: renamed into place, fragment never written
    shutil.copy(shards[1], work.root / "shards" / shards[1].name)
    # shard 2: a torn temporary file
    (work.root / "shards" / f"{shards[2].name}{TEMP_MARKER}abc").write_bytes(b"\0" * 100)
    # shard 3: fragment present but the shard truncated
    data = shards[3].read_bytes()
    (work.root / "shards" / shards[3].name).write_bytes(data[: len(data) // 2])
    (work.fragments_dir / f"{shards[3].stem}.json").write_text(
        _fragment_for(scratch, shards[3].name)
    )

    summary = run(cfg)
    assert summary["tokens_this_attempt"] == sum(LENGTHS[1:6])  # all but shard 0 redone
    _assert_complete(out, tokenized)


def _fragment_for(dataset: Path, shard_name: str) -> str:
    """The fragment a run would have written for one shard of a finished dataset."""
    import json

    table = pq.read_table(dataset / "manifest.parquet").to_pylist()
    rel = f"shards/{shard_name}"
    rows = [
        {k: r[k] for k in ("sample_id", "row_start", "num_tokens", "num_loss_tokens", "checksum")}
        for r in table
        if r["shard"] == rel
    ]
    return json.dumps(
        {
            "name": shard_name.split(".")[0],
            "shard": rel,
            "file_bytes": (dataset / rel).stat().st_size,
            "rows": rows,
            "rejected": [],
        }
    )


def test_resume_refuses_changed_settings(
    llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ds"
    cfg = _config(llama_target, tokenized, out)
    from eagle3_extract.run import resolve

    WorkDir(out).prepare(resolve(cfg).identity())
    with pytest.raises(ResumeError, match="storage_dtype"):
        run(_config(llama_target, tokenized, out, storage_dtype="float16"))


def _ranks(model: Path, tokenized: Path, root: Path, world: int, **kwargs) -> list[Path]:
    outs = []
    for rank in range(world):
        out = root / f"rank{rank}"
        run(_config(model, tokenized, out, rank=rank, world_size=world, **kwargs))
        outs.append(out)
    return outs


def test_workers_write_disjoint_shards_that_merge_into_the_whole(
    llama_target: Path, tmp_path: Path
) -> None:
    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=LENGTHS[:11])
    outs = _ranks(llama_target, tokenized, tmp_path, world=3)
    per_rank = [
        set(pq.read_table(o / "manifest.parquet").column("sample_id").to_pylist()) for o in outs
    ]
    assert all(per_rank) and sum(map(len, per_rank)) == 11
    assert not (per_rank[0] & per_rank[1]) and not (per_rank[1] & per_rank[2])
    merged = tmp_path / "merged"
    assert main(["merge", "--out", str(merged), *map(str, outs)]) == 0
    _assert_complete(merged, tokenized)
    header = read_header(merged).fields
    assert header["shard_index"] == 0 and header["num_shards_total"] == 1
    assert [m["rank"] for m in header["merged_from"]] == [0, 1, 2]
    # Each rank's extraction record (which samples it took, how) survives the merge.
    assert [m["extraction"] for m in header["merged_from"]] == [
        read_header(o).fields["extraction"] for o in outs
    ]
    assert all(m["extraction"]["selection"] for m in header["merged_from"])


def test_merge_refuses_overlap_missing_ranks_and_lineage_mismatch(
    target_factory: Callable[..., Path], llama_target: Path, tmp_path: Path
) -> None:
    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=LENGTHS[:6])
    rank0, _ = _ranks(llama_target, tokenized, tmp_path / "a", world=2)

    with pytest.raises(MergeError, match="rank 0 appears twice"):
        merge([rank0, rank0], tmp_path / "m1")
    with pytest.raises(MergeError, match=r"ranks \[1\] of world size 2 are missing"):
        merge([rank0], tmp_path / "m2")
    assert merge([rank0], tmp_path / "m2", allow_missing_ranks=True)["samples"] == 3

    # Overlapping samples: a single-worker dataset holds every sample of rank 0.
    whole = tmp_path / "whole"
    run(_config(llama_target, tokenized, whole))
    with pytest.raises(MergeError, match=r"sample 'sample-0' is in both"):
        merge([whole, tmp_path / "m2"], tmp_path / "m3")

    # Another target (other weights): lineage differs; rank 1 of it completes the ranks.
    other = target_factory("llama", seed=7)
    _, other1 = _ranks(other, tokenized, tmp_path / "b", world=2)
    with pytest.raises(MergeError, match="lineage 'target_fingerprint'") as info:
        merge([rank0, other1], tmp_path / "m4")
    assert str(rank0) in str(info.value) and str(other1) in str(info.value)
    # Other layer ids: lineage and header both differ.
    _, ids1 = _ranks(llama_target, tokenized, tmp_path / "c", world=2, aux_layer_ids=(0, 2, 3))
    with pytest.raises(MergeError, match="aux_layer_ids"):
        merge([rank0, ids1], tmp_path / "m5")
    assert main(["merge", "--out", str(tmp_path / "m6"), str(rank0), str(other1)]) == 1
    for name in ("m1", "m3", "m4", "m5", "m6"):
        assert not (tmp_path / name).exists()
    assert not any(TEMP_MARKER in p.name for p in tmp_path.iterdir())
    assert os.listdir(tmp_path / "m2")  # the allowed partial merge exists
