"""A stream (``OUT.partial``) made in milliseconds from a finished synthetic hidden-state
dataset, without running an extraction: its shards, one fragment per sealed shard, the
stream header (the dataset's header plus its ``stream`` section) and, when the producer is
meant to be done, ``end.json``. What eagle3-extract --stream writes, in the layout of
eagle3_schemas.contract.stream, so the trainer's stream refusals can be tested one by one."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pyarrow.parquet as pq

from eagle3_schemas.contract.stream import (
    END_FILE,
    FRAGMENTS,
    STREAM_FILE,
    TARGET_HEAD,
    Fragment,
    ManifestRow,
    partial_dir,
    stream_section,
)
from eagle3_schemas.io.atomic import write_json_atomic


def stream_of(
    finished: Path,
    out: Path,
    *,
    budget: int | None = None,
    epochs: int = 1,
    sealed: int | None = None,
    end: bool = True,
) -> Path:
    """The stream of ``out`` (its ``OUT.partial``) holding ``finished``'s shards, planned
    ``epochs`` times; the first ``sealed`` planned shards (all when None) are sealed. Returns
    the stream's directory."""
    root = partial_dir(out)
    (root / "shards").mkdir(parents=True)
    (root / FRAGMENTS).mkdir(parents=True)
    shutil.copyfile(finished / TARGET_HEAD, root / TARGET_HEAD)
    rows: dict[str, list[dict]] = {}
    for row in pq.read_table(finished / "manifest.parquet").to_pylist():
        rows.setdefault(row["shard"], []).append(row)
    shards = list(rows)
    per_token = max(
        math.ceil((finished / s).stat().st_size / sum(r["num_tokens"] for r in rows[s]))
        for s in shards
    )
    plan = [
        (f"e{e}-{Path(s).stem}", s) for e in range(epochs) for s in shards
    ]  # one copy of the dataset's shards per epoch, under their own names
    header = json.loads((finished / "dataset.json").read_text(encoding="utf-8"))
    header["stream"] = stream_section(
        [(name, [(r["sample_id"], r["num_tokens"]) for r in rows[s]]) for name, s in plan],
        per_token,
        budget,
        epochs,
    )
    write_json_atomic(root / STREAM_FILE, header)
    for name, s in plan[: len(plan) if sealed is None else sealed]:
        seal(root, finished, name, s, rows[s])
    if end:
        write_json_atomic(root / END_FILE, {"status": "stream complete"})
    return root


def seal_rest(root: Path, finished: Path) -> None:
    """Seal every planned shard not sealed yet, then end the stream (a late producer)."""
    rows: dict[str, list[dict]] = {}
    for row in pq.read_table(finished / "manifest.parquet").to_pylist():
        rows.setdefault(row["shard"], []).append(row)
    shards = list(rows)
    plan = json.loads((root / STREAM_FILE).read_text(encoding="utf-8"))["stream"]["plan"]
    for i, planned in enumerate(plan):
        name = planned["name"]
        if not (root / FRAGMENTS / f"{name}.json").is_file():
            shard = shards[i % len(shards)]
            seal(root, finished, name, shard, rows[shard])
    write_json_atomic(root / END_FILE, {"status": "stream complete"})


def seal(root: Path, finished: Path, name: str, shard: str, rows: list[dict]) -> None:
    """Copy the shard under its planned name, then write its fragment (the producer's order)."""
    target = root / "shards" / f"{name}.safetensors"
    shutil.copyfile(finished / shard, target)
    fragment = Fragment(
        name,
        f"shards/{target.name}",
        target.stat().st_size,
        [
            ManifestRow(
                r["sample_id"], r["row_start"], r["num_tokens"], r["num_loss_tokens"], r["checksum"]
            )
            for r in rows
        ],
    )
    write_json_atomic(root / FRAGMENTS / f"{name}.json", fragment.to_json())
