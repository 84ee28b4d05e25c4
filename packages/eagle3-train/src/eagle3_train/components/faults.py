"""Exit statuses, and the map from what stopped a run to its status (every rank the same:
a rank whose collective failed because another stopped on a fault exits with that fault's
status, causes.py).

0 done, 2 a config or preflight error, 3 a non-finite loss stopped training, 4 the stream
failed, 5 preempted (checkpoint kept), 6 a corrupt sample (data.on_corrupt: stop), 7 a full
disk, 8 a collective with the other ranks failed (and no other rank left its cause).
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from eagle3_schemas.io.diskspace import EXIT_DISK_FULL, DiskFull
from eagle3_train.components.causes import Cause, find_cause, peer_message, record_cause
from eagle3_train.components.checkpoint import Checkpoints
from eagle3_train.config.run_config import Config
from eagle3_train.data.dataset import CorruptSample
from eagle3_train.data.stream import StreamError

log = logging.getLogger(__name__)

EXIT_PREFLIGHT = 2
EXIT_NAN = 3
EXIT_STREAM = 4
EXIT_PREEMPTED = 5
EXIT_CORRUPT = 6
EXIT_PEER = 8
# EXIT_DISK_FULL (7) is every stage's, from eagle3_schemas.io.diskspace

# how gloo / NCCL / torch.distributed word a peer that is gone or silent
_PEER_FAILURES = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",
    "Timed out",
    "timed out",
    "Timeout",
    "NCCL",
    "ProcessGroup",
)


class TrainingStopped(RuntimeError):
    """Training stopped on purpose (NaN loss); the message says why and what was kept."""


def exit_status(error: Exception, config: Config) -> int | None:
    """The exit status of a run that ``error`` stopped (logged where the raiser did not), or
    None for an error that is no known fault: a bug, to be raised with its traceback. Under
    several ranks a fault of this rank's own is left for the others (causes.py), and a failed
    collective ends with the status of what stopped another rank, where it left one."""
    rank, world = _rank_and_world()
    where = f" (rank {rank})" if world > 1 else ""
    if isinstance(error, TrainingStopped):  # (logged by the raiser)
        status, what = EXIT_NAN, "a non-finite loss stopped training"
    elif isinstance(error, StreamError):  # the last checkpoint stands; rerun once it is mended
        status, what = EXIT_STREAM, "stream"
    elif isinstance(error, CorruptSample):  # data.on_corrupt: stop; the last checkpoint stands
        status, what = EXIT_CORRUPT, "damaged shard"
    elif isinstance(error, DiskFull):  # nothing half-written; the last checkpoint stands
        status, what = EXIT_DISK_FULL, "disk full"
    elif isinstance(error, RuntimeError) and is_collective_failure(error):
        status, message = after_collective_failure(
            config, collective_failure_message(error, config)
        )
        log.error("%s", message)
        return status
    else:
        return None
    if status != EXIT_NAN:
        log.error("%s%s: %s", what, where, error)
    if world > 1:
        record_cause(config.output_dir, Cause(rank, status, f"{what}: {error}"))
    return status


def after_collective_failure(config: Config, message: str) -> tuple[int, str]:
    """(status, message) of a rank whose collective with the others failed: the cause's, where
    another rank left one (causes.py), else EXIT_PEER and ``message``."""
    me, world = _rank_and_world()
    cause = find_cause(config.output_dir, me, world)
    if cause is None:
        return EXIT_PEER, message
    return cause.status, peer_message(me, cause)


def _rank_and_world() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_collective_failure(error: BaseException) -> bool:
    """A torch.distributed collective failed: another rank died or stopped answering."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(s in text for s in _PEER_FAILURES)


def collective_failure_message(error: BaseException, config: Config) -> str:
    rank = os.environ.get("RANK", "?")
    latest = Checkpoints.of(config).latest()
    last = str(latest) if latest is not None else "none yet"
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return (
        f"rank {rank}: a collective with the other ranks failed ({first}): another rank died "
        f"or answered nothing for train.collective_timeout_s={config.train.collective_timeout_s:g}"
        f" s. Stopped; last checkpoint: {last}. Look at the other ranks' logs, then relaunch the "
        "same command on every node to resume from it"
    )
