"""merge: join the datasets of several workers (``--rank/--world-size``) into one.

Refuses, naming both sides: inputs that do not validate, differing lineage / target / layer ids
/ storage / backend, differing target heads, a sample id in two inputs, a rank given twice, and
(unless allowed) missing ranks. Shards are hard-linked (copied across filesystems) into the
merged directory, which is built under a temporary name and renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_schemas.contract.header import (
    make_header,
    read_header,
    write_json_header,
    write_parquet,
)
from eagle3_schemas.contract.lineage import fingerprint_artifact, fingerprint_file
from eagle3_schemas.contract.paths import check_input_artifact, check_output_artifact
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.io.atomic import atomic_directory

log = logging.getLogger(__name__)

# Header fields every input must share; counts and the rank differ by design.
SHARED_FIELDS = ("target", "aux_layer_ids", "storage_dtype", "backend", "compute_dtype")


class MergeError(ValueError):
    pass


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def check_inputs(inputs: Sequence[Path], allow_missing_ranks: bool = False) -> list[str]:
    problems: list[str] = []
    for path in inputs:
        violations = validate(path)
        if violations:
            problems.append(
                f"{path}: does not validate: {violations[0]} (+{len(violations) - 1} more)"
            )
    if problems:
        return problems
    headers = [read_header(p) for p in inputs]
    first, first_path = headers[0], inputs[0]
    head_fp = fingerprint_file(first_path / "target_head.safetensors")
    for path, header in zip(inputs[1:], headers[1:], strict=True):
        if header.lineage != first.lineage:
            keys = sorted(
                k
                for k in {*header.lineage, *first.lineage}
                if header.lineage.get(k) != first.lineage.get(k)
            )
            for key in keys:
                problems.append(
                    f"lineage {key!r}: {path} has {header.lineage.get(key)!r} but {first_path} has "
                    f"{first.lineage.get(key)!r}"
                )
        for key in SHARED_FIELDS:
            if header.fields.get(key) != first.fields.get(key):
                problems.append(
                    f"{key}: {path} has {header.fields.get(key)!r} but {first_path} has "
                    f"{first.fields.get(key)!r}"
                )
        if fingerprint_file(path / "target_head.safetensors") != head_fp:
            problems.append(f"target_head.safetensors of {path} differs from that of {first_path}")
    worlds = {h.fields["num_shards_total"] for h in headers}
    if len(worlds) > 1:
        problems.append(f"inputs were written with different world sizes {sorted(worlds)}")
    elif (world := worlds.pop()) > 1:
        ranks: dict[int, Path] = {}
        for path, header in zip(inputs, headers, strict=True):
            rank = header.fields["shard_index"]
            if rank in ranks:
                problems.append(f"rank {rank} appears twice: {ranks[rank]} and {path}")
            ranks.setdefault(rank, path)
        missing = sorted(set(range(world)) - set(ranks))
        if missing and not allow_missing_ranks:
            problems.append(
                f"ranks {missing} of world size {world} are missing: the merged dataset would "
                "silently lack their samples (pass --allow-missing-ranks to merge anyway)"
            )
    owners: dict[str, Path] = {}
    shard_owner: dict[str, Path] = {}
    for path in inputs:
        manifest = pq.read_table(path / "manifest.parquet", columns=["sample_id", "shard"])
        for sample_id in manifest.column("sample_id").to_pylist():
            if sample_id in owners:
                problems.append(f"sample {sample_id!r} is in both {owners[sample_id]} and {path}")
                if len(problems) > 20:
                    return problems
            owners.setdefault(sample_id, path)
        for shard in set(manifest.column("shard").to_pylist()):
            if shard in shard_owner:
                problems.append(f"shard name {shard!r} is in both {shard_owner[shard]} and {path}")
            shard_owner.setdefault(shard, path)
    return problems


def merge(inputs: Sequence[Path], out: Path, allow_missing_ranks: bool = False) -> dict[str, Any]:
    if len(inputs) < 1:
        raise MergeError("merge needs at least one input dataset")
    # Paths first: validating the inputs reads every row, minutes for a large dataset.
    for path in inputs:
        check_input_artifact(path, "hidden_states", "input")
    check_output_artifact(out, "hidden_states", "--out")
    problems = check_inputs(inputs, allow_missing_ranks)
    if problems:
        raise MergeError("refusing to merge:\n  " + "\n  ".join(problems))
    headers = [read_header(p) for p in inputs]
    tables = [pq.read_table(p / "manifest.parquet") for p in inputs]
    with atomic_directory(out) as tmp:
        (tmp / "shards").mkdir()
        for path, table in zip(inputs, tables, strict=True):
            for shard in sorted(set(table.column("shard").to_pylist())):
                _link(path / shard, tmp / shard)
        shutil.copy2(inputs[0] / "target_head.safetensors", tmp / "target_head.safetensors")
        manifest = pa.concat_tables(tables)
        write_parquet(tmp / "manifest.parquet", manifest)
        first = headers[0]
        fields = dict(first.fields)
        fields.update(
            num_samples=manifest.num_rows,
            num_tokens=sum(manifest.column("num_tokens").to_pylist()),
            shard_index=0,
            num_shards_total=1,
            rejected_samples=[r for h in headers for r in h.fields.get("rejected_samples", [])],
            merged_from=[
                {
                    "path": str(p),
                    "rank": h.fields["shard_index"],
                    "world_size": h.fields["num_shards_total"],
                    "num_samples": h.fields["num_samples"],
                    "fingerprint": fingerprint_artifact(p),
                    # each rank's own record (its sample selection, timings) stays with it
                    "extraction": h.fields.get("extraction"),
                }
                for p, h in zip(inputs, headers, strict=True)
            ],
        )
        fields.pop("extraction", None)
        write_json_header(
            tmp / "dataset.json", make_header("hidden_states", first.lineage, **fields)
        )
        violations = validate(tmp)
        if violations:
            raise MergeError(
                "merged dataset does not validate:\n  "
                + "\n  ".join(str(v) for v in violations[:20])
            )
    return {"out": str(out), "inputs": len(inputs), "samples": manifest.num_rows}
