"""The producer side of a stream: its header, and the disk budget it pauses on.

The layout and the rules both sides follow are eagle3_schemas.contract.stream's. Here: the header a
consumer checks lineage on before any shard exists, and ``DiskGate``, which holds back the
next shards while writing them would take ``shards/`` past the budget; the consumer's
reclaim (delete after checkpoint) is what lets it go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

from eagle3_extract.plan import ShardPlan
from eagle3_schemas.contract.stream import CONSUMER_STOPPED, shard_bytes_on_disk

log = logging.getLogger(__name__)

# Safetensors JSON header and alignment padding of one shard, on top of its tensor bytes.
SHARD_HEADER_BYTES = 4096


class DiskBudgetError(RuntimeError):
    """The budget cannot hold the next unit of work, and nothing will free room for it."""


def planned_bytes(plans: Sequence[ShardPlan], per_token: int) -> int:
    return sum(
        p.num_tokens * per_token + 8 * (len(p.samples) + 1) + SHARD_HEADER_BYTES for p in plans
    )


class DiskGate:
    """Blocks until the shards on disk plus the next group's planned size fit the budget."""

    def __init__(
        self, root: Path, budget: int | None, per_token: int, poll_seconds: float = 0.2
    ) -> None:
        self.root = root
        self.budget = budget
        self.per_token = per_token
        self.poll_seconds = poll_seconds
        self.paused_seconds = 0.0
        self.peak_bytes = 0

    def check_fits(self, groups: Sequence[Sequence[ShardPlan]]) -> None:
        if self.budget is None or not groups:
            return
        largest = max(groups, key=lambda g: planned_bytes(g, self.per_token))
        need = planned_bytes(largest, self.per_token)
        if need > self.budget:
            raise DiskBudgetError(
                f"--disk-budget {self.budget} bytes is smaller than one unit of work: "
                f"{', '.join(p.name for p in largest)} need {need} bytes; lower --shard-mb "
                "(or --shards-per-call with the vLLM backend) or raise the budget"
            )

    def wait_for_room(self, group: Sequence[ShardPlan]) -> None:
        if self.budget is None:
            return
        need = planned_bytes(group, self.per_token)
        started = None
        while True:
            used = shard_bytes_on_disk(self.root)
            self.peak_bytes = max(self.peak_bytes, used)
            if used + need <= self.budget:
                break
            if (self.root / CONSUMER_STOPPED).is_file():
                raise DiskBudgetError(
                    f"the trainer reading {self.root} has stopped ({self.root / CONSUMER_STOPPED}) "
                    f"and reclaims nothing more; {group[0].name} and later shards do not fit "
                    "the budget. Rerun this command with the trainer running to finish the stream"
                )
            if started is None:
                started = time.perf_counter()
                log.info(
                    "stream paused: %d bytes of shards on disk + %d for %s exceed the budget of "
                    "%d; waiting for the trainer to reclaim consumed shards",
                    used,
                    need,
                    group[0].name,
                    self.budget,
                )
            time.sleep(self.poll_seconds)
        if started is not None:
            waited = time.perf_counter() - started
            self.paused_seconds += waited
            log.info("stream resumed after %.1f s", waited)
