"""The run's working directory: resume after a crash, then finalize into the dataset atomically.

Layout while a run is in progress (beside the final path ``OUT``)::

    OUT.partial/
      shards/r00000-000000.safetensors      complete shards (each written atomically)
      _work/run.json                         the run's identity (inputs, layer ids, plan, ...)
      _work/fragments/r00000-000000.json     manifest rows of each complete shard
      _work/stream.json, consumed/, end.json  a stream only (--stream): eagle3_schemas.contract.stream

A fragment is written only after its shard was renamed into place, so: fragment present and the
shard's size as recorded = shard complete; a shard without a fragment = the run died between
the two renames, and it is redone; temporary files are leftovers of a killed write. Finishing
writes manifest, target head and dataset.json (last); the run validates the result, then
renames ``OUT.partial`` to ``OUT``: ``OUT`` exists only complete and valid. A stream is
not published (its consumer reads ``OUT.partial``); rerun without ``--stream`` afterwards to
publish it, possible only while no shard was reclaimed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from eagle3_extract.plan import ShardPlan
from eagle3_extract.writer import save_safetensors
from eagle3_schemas.contract.header import Header, write_json_header, write_parquet
from eagle3_schemas.contract.stream import (
    END_FILE,
    FRAGMENTS,
    STREAM_FILE,
    TARGET_HEAD,
    WORK,
    Fragment,
    consumed,
    partial_dir,
)
from eagle3_schemas.io.atomic import TEMP_MARKER, write_json_atomic
from eagle3_schemas.layouts.hidden_states import SHARD_DIR

log = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """The partial run on disk cannot be resumed or finished as asked (other inputs or
    settings; a stream whose shards a trainer reclaimed)."""


def is_complete(final: Path) -> bool:
    return (final / "dataset.json").is_file()


class WorkDir:
    def __init__(self, final: Path) -> None:
        self.final = final
        self.root = partial_dir(final)
        self.fragments_dir = self.root / FRAGMENTS
        self.run_file = self.root / WORK / "run.json"

    def resumable(self, identity: dict[str, Any]) -> bool:
        """True when a partial run of the same identity is on disk; raises if it differs."""
        if not self.run_file.is_file():
            return False
        found = json.loads(self.run_file.read_text(encoding="utf-8"))
        differing = sorted(k for k in set(found) | set(identity) if found.get(k) != identity.get(k))
        if differing:
            details = "; ".join(
                f"{k}: on disk {found.get(k)!r}, now {identity.get(k)!r}" for k in differing
            )
            raise ResumeError(
                f"{self.root} holds a partial run with different settings ({details}). "
                f"Rerun with the same settings to resume, or delete {self.root} to restart."
            )
        return True

    def prepare(self, identity: dict[str, Any]) -> bool:
        """Create the work dir, or check that the one on disk belongs to the same run.

        Returns True when resuming.
        """
        if self.resumable(identity):
            return True
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        self.fragments_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run_file, identity)
        return False

    def completed(self, plans: Sequence[ShardPlan]) -> dict[str, Fragment]:
        """Fragments of complete shards; removes torn leftovers so they are redone."""
        if not self.fragments_dir.is_dir():
            return {}
        planned = {p.name: p for p in plans}
        done: dict[str, Fragment] = {}
        for path in sorted(self.fragments_dir.glob("*.json")):
            fragment = Fragment.from_json(json.loads(path.read_text(encoding="utf-8")))
            plan = planned.get(fragment.name)
            shard_ok = (
                fragment.shard is None
                or consumed(self.root, fragment.name)  # trained on, then reclaimed
                or (
                    (self.root / fragment.shard).is_file()
                    and (self.root / fragment.shard).stat().st_size == fragment.file_bytes
                )
            )
            if plan is None or not shard_ok:
                log.warning("discarding fragment %s (shard missing, torn or not planned)", path)
                path.unlink()
                continue
            done[fragment.name] = fragment
        for directory in (self.root / SHARD_DIR, self.fragments_dir):
            for path in directory.iterdir():
                stem = path.name.split(".", 1)[0]
                if TEMP_MARKER in path.name:
                    log.info("removing leftover temporary file %s", path)
                    path.unlink()
                elif directory.name == SHARD_DIR and stem not in done:
                    log.info("removing shard %s written without its fragment (redone)", path)
                    path.unlink()
        return done

    def finish(
        self,
        plans: Sequence[ShardPlan],
        fragments: dict[str, Fragment],
        header: Header,
        head: dict[str, Any],
    ) -> Path:
        """Write manifest, target head and dataset.json (last) into the work dir; returns it."""
        missing = [p.name for p in plans if p.name not in fragments]
        if missing:
            raise RuntimeError(f"{self.root}: shards {missing[:5]} are not complete; cannot finish")
        gone = [p.name for p in plans if consumed(self.root, p.name)]
        if gone:
            raise ResumeError(
                f"{self.root}: {len(gone)} shards ({gone[:3]}...) were reclaimed by the training "
                "run that consumed this stream: it cannot become a finished dataset"
            )
        rows = [r for p in plans for r in fragments[p.name].rows]
        shards = [fragments[p.name].shard for p in plans for _ in fragments[p.name].rows]
        table = pa.table(
            {
                "sample_id": pa.array([r.sample_id for r in rows], pa.string()),
                "shard": pa.array(shards, pa.string()),
                "row_start": pa.array([r.row_start for r in rows], pa.int64()),
                "num_tokens": pa.array([r.num_tokens for r in rows], pa.int32()),
                "num_loss_tokens": pa.array([r.num_loss_tokens for r in rows], pa.int32()),
                "checksum": pa.array([r.checksum for r in rows], pa.string()),
            }
        )
        write_parquet(self.root / "manifest.parquet", table)
        if not (self.root / TARGET_HEAD).is_file():  # a stream wrote it first
            save_safetensors(self.root / TARGET_HEAD, head)
        write_json_header(self.root / "dataset.json", header)
        return self.root

    def open_stream(self, header: Header, head: dict[str, Any]) -> None:
        """What a consumer needs before the first shard: the target head, then the header."""
        if not (self.root / TARGET_HEAD).is_file():
            save_safetensors(self.root / TARGET_HEAD, head)
        write_json_atomic(self.root / STREAM_FILE, header.to_json())
        (self.root / END_FILE).unlink(missing_ok=True)  # a restarted producer is not done

    def end_stream(self, summary: dict[str, Any]) -> None:
        write_json_atomic(self.root / END_FILE, summary)

    def publish(self) -> Path:
        """The rename that makes the dataset appear, complete, under its final name."""
        os.rename(self.root, self.final)
        fd = os.open(self.final.parent, os.O_RDONLY)  # make the rename itself durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        shutil.rmtree(self.final / WORK)
        return self.final


def cleanup_finished(final: Path) -> None:
    """A run killed between publishing and removing its work files leaves ``_work`` behind."""
    if (final / WORK).exists():
        shutil.rmtree(final / WORK)
