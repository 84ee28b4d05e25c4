"""What one extraction run has resolved before capturing: the ``RunContext`` every backend reads.

Its own module so that ``run.py`` (which builds it and calls the backends) and the backends
(which read it) both import it, and neither imports the other back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from eagle3_extract.config import ExtractConfig
from eagle3_extract.plan import ShardPlan, plan_fingerprint
from eagle3_extract.samples import Tokenized
from eagle3_extract.target import TargetInfo


@dataclass
class RunContext:
    config: ExtractConfig
    target: TargetInfo
    tokenized: Tokenized
    aux_layer_ids: list[int]
    plans: list[ShardPlan]
    lineage: dict[str, Any]
    # Called by the backends before capturing each group of shards (a stream's disk budget).
    make_room: Callable[[Sequence[ShardPlan]], None] = lambda group: None
    # Checked by the backends after each sealed shard (group): True = leave now (preempted).
    should_stop: Callable[[], bool] = lambda: False

    @property
    def layer_ids(self) -> list[int]:
        """What is captured: the aux ids, then id N (the last hidden state, pre-norm)."""
        return [*self.aux_layer_ids, self.target.num_hidden_layers]

    @property
    def compute_dtype(self) -> str:
        if self.config.compute_dtype != "auto":
            return self.config.compute_dtype
        if self.config.backend == "hf":
            return "float32"  # the reference computes in full precision
        return self.target.torch_dtype or "auto"

    def identity(self) -> dict[str, Any]:
        """What a resumed run must share with the partial one on disk."""
        c = self.config
        return {
            "lineage": self.lineage,
            "backend": c.backend,
            "compute_dtype": self.compute_dtype,
            "storage_dtype": c.storage_dtype,
            "rank": c.rank,
            "world_size": c.world_size,
            "plan_fingerprint": plan_fingerprint(self.plans),
        }
