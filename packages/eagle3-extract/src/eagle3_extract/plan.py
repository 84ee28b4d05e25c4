"""The shard plan: which samples a worker owns and which shard each lands in.

The plan is a pure function of the tokenized input, rank, world size and shard size, so a rerun
after a crash recomputes the same plan and skips exactly the shards already written. Sample
``i`` (row of the tokenized file) belongs to rank ``i % world_size``: interleaving keeps the
ranks' loads even when the input is sorted by length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle3_extract.samples import Sample
from eagle3_schemas.contract.lineage import fingerprint_json
from eagle3_schemas.layouts.hidden_states import SHARD_DIR

ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1}
# Per-token bytes besides the hidden states: input_ids (int32) + loss_mask (uint8).
TOKEN_META_BYTES = 4 + 1
# Per-sample bytes: one cu_seqlens entry (int64).
SAMPLE_META_BYTES = 8


def hidden_bytes_per_token(n_aux: int, hidden_size: int, storage_dtype: str) -> int:
    """Bytes of the hidden states alone: ``(n_aux + 1) * H * element size`` (+ fp8 scales)."""
    scales = 4 * (n_aux + 1) if storage_dtype == "fp8_e4m3" else 0
    return (n_aux + 1) * hidden_size * ELEMENT_BYTES[storage_dtype] + scales


def bytes_per_token(n_aux: int, hidden_size: int, storage_dtype: str) -> int:
    """Everything a shard stores per token."""
    return hidden_bytes_per_token(n_aux, hidden_size, storage_dtype) + TOKEN_META_BYTES


@dataclass(frozen=True)
class ShardPlan:
    name: str
    samples: tuple[Sample, ...]

    @property
    def rel_path(self) -> str:
        return f"{SHARD_DIR}/{self.name}.safetensors"

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


def shard_name(rank: int, index: int) -> str:
    return f"r{rank:05d}-{index:06d}"


def plan_shards(
    samples: Sequence[Sample], rank: int, world_size: int, shard_tokens: int
) -> list[ShardPlan]:
    """Cut this rank's samples, in input order, into shards of at most ``shard_tokens`` tokens
    (a longer sample gets a shard of its own)."""
    mine = [s for s in samples if s.index % world_size == rank]
    plans: list[ShardPlan] = []
    current: list[Sample] = []
    tokens = 0
    for sample in mine:
        if current and tokens + sample.num_tokens > shard_tokens:
            plans.append(ShardPlan(shard_name(rank, len(plans)), tuple(current)))
            current, tokens = [], 0
        current.append(sample)
        tokens += sample.num_tokens
    if current:
        plans.append(ShardPlan(shard_name(rank, len(plans)), tuple(current)))
    return plans


def epoch_plan(plan: ShardPlan, epoch: int) -> ShardPlan:
    """The shard as extracted again for training epoch ``epoch`` of a stream (--epochs)."""
    return ShardPlan(f"e{epoch:03d}-{plan.name}", plan.samples)


def shard_tokens_for(shard_mb: float, per_token: int) -> int:
    return max(1, int(shard_mb * 2**20) // per_token)


def plan_fingerprint(plans: Sequence[ShardPlan]) -> str:
    """Identity of a plan: shard names and the (id, length) of their samples, in order."""
    return fingerprint_json(
        [[p.name, [[s.sample_id, s.num_tokens] for s in p.samples]] for p in plans]
    )
