"""What stopped another rank. A rank that stops on a fault with a status of its own (a corrupt
sample, a full disk, a NaN, the stream) leaves a record, ``<output_dir>/faults/rank-<R>.json``
(status, message, rank; written atomically), before it exits. A peer that then finds a
collective failed (the stopped rank's connections closed, or it answers nothing) waits briefly
for such a record and exits with the cause's status and a message naming the rank, instead of
the collective failure's 8. The ranks share output_dir, as their checkpoints already do.

Each rank removes its own record as it starts, before it joins the process group: a peer sees
a collective fail only after every rank has joined, so an earlier attempt's record is never
read as this one's (and ranks an earlier, larger attempt had are not read at all).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from eagle3_schemas.io.atomic import write_json_atomic

log = logging.getLogger(__name__)

FAULTS_DIR = "faults"
# How long a peer that saw a collective fail looks for the cause's record: it is written before
# the stopped rank exits (so before its connections close), but a shared filesystem may show
# it late.
WAIT_S = 5.0


@dataclass(frozen=True)
class Cause:
    rank: int
    status: int
    message: str


def _record_path(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / FAULTS_DIR / f"rank-{rank}.json"


def clear_record(output_dir: str | Path, rank: int) -> None:
    """This rank's record of an earlier attempt, removed (at start)."""
    _record_path(output_dir, rank).unlink(missing_ok=True)


def record_cause(output_dir: str | Path, cause: Cause) -> None:
    """Leave ``cause`` for the peers. Where it cannot be written (the disk that would hold it is
    the full one), they stop with the collective failure's status; this rank's log says why."""
    path = _record_path(output_dir, cause.rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            path, {"rank": cause.rank, "status": cause.status, "message": cause.message}
        )
    except OSError as e:
        log.error(
            "rank %d: could not leave the cause for the other ranks at %s (%s)", cause.rank, path, e
        )


def _read(path: Path) -> Cause | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return Cause(int(data["rank"]), int(data["status"]), str(data["message"]))
    except (OSError, ValueError, KeyError, TypeError):  # gone, or not one of ours
        return None


def find_cause(output_dir: str | Path, me: int, world: int, wait_s: float = WAIT_S) -> Cause | None:
    """Another rank's record (the lowest rank's, where several stopped), looked for up to
    ``wait_s`` seconds; None when no other rank left one (it was killed, or froze). Only this
    attempt's ranks (0 .. world-1) are read: a record of a rank an earlier, larger attempt had
    is not this attempt's."""
    paths = [_record_path(output_dir, r) for r in range(world) if r != me]
    if not paths:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        for path in paths:
            cause = _read(path)
            if cause is not None:
                return cause
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.1)


def peer_message(me: int, cause: Cause) -> str:
    return (
        f"rank {me}: stopped with exit {cause.status} because rank {cause.rank} stopped "
        f"(every rank exits with the status of the cause): rank {cause.rank}: {cause.message}"
    )
