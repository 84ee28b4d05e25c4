"""The typed extraction config: every knob of a run in one place, with its defaults and checks.

This module imports nothing heavy (no torch, no transformers, no vLLM), so the vLLM-side driver
and the connector can read it in vLLM's own environment.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_schemas.runtime.signals import parse_signals

BACKENDS = ("hf", "vllm")
STORAGE_DTYPES = ("bfloat16", "float16", "float32", "fp8_e4m3")
COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_SHARD_MB = 1024
# What --model must name, in the messages that refuse it.
MODEL_EXPECTED = "a target model directory (Hugging Face format, with config.json)"


class ConfigError(ValueError):
    """A run configuration that cannot work; the message says which knob and why."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default auxiliary layers ``[2, N//2, N-3]`` (vLLM layer-id convention).

    Those three ids are distinct and inside ``[1, N-1]`` only from N = 7 on; a shallower target
    (the embedded 6-layer one, 2-layer test targets) would get duplicates or ids below zero.
    There the ids are spread evenly instead: round-half-up of ``k*N/4`` for k = 1, 2, 3,
    deduplicated (N = 6 gives [2, 3, 5]; N = 2 gives [1, 2]).
    """
    if num_layers < 1:
        raise ConfigError(f"num_hidden_layers must be >= 1, found {num_layers}")
    ids = [2, num_layers // 2, num_layers - 3]
    if ids == sorted(set(ids)) and ids[0] >= 1 and ids[-1] <= num_layers - 1:
        return ids
    return sorted({(k * num_layers + 2) // 4 for k in (1, 2, 3)})


def check_layer_ids(aux_layer_ids: list[int], num_layers: int) -> None:
    """Raise ConfigError unless ids are sorted, unique and inside [0, N] (vLLM convention)."""
    if not aux_layer_ids:
        raise ConfigError("aux_layer_ids is empty; EAGLE-3 needs at least one auxiliary layer")
    if aux_layer_ids != sorted(set(aux_layer_ids)):
        raise ConfigError(f"aux_layer_ids {aux_layer_ids} must be sorted ascending and unique")
    bad = [i for i in aux_layer_ids if not 0 <= i <= num_layers]
    if bad:
        raise ConfigError(
            f"aux_layer_ids {bad} lie outside [0, {num_layers}] for a target of {num_layers} "
            "decoder layers (vLLM convention: 0 = embeddings output, N = last layer output "
            "before the final norm)"
        )


@dataclass(frozen=True)
class ExtractConfig:
    """One extraction run. Paths are resolved; ``aux_layer_ids`` is None until resolved."""

    model: Path
    tokenized: Path
    out: Path
    backend: str = "hf"
    aux_layer_ids: tuple[int, ...] | None = None
    storage_dtype: str = "bfloat16"
    # dtype the target computes in; "auto" = float32 for hf (the reference), the model's for vLLM
    compute_dtype: str = "auto"
    rank: int = 0
    world_size: int = 1
    shard_mb: float = DEFAULT_SHARD_MB
    # hf backend: padded tokens per forward batch
    batch_tokens: int = 8192
    # hf: where the target runs (cpu, cuda, cuda:N); vLLM places its engine itself
    device: str = "cpu"
    max_samples: int | None = None
    # With max_samples: draw that many rows at random with this seed instead of the first ones
    # (a corpus sorted by source would make the first rows a biased subset).
    sample_seed: int | None = None
    preflight: bool = True
    validate_output: bool = True
    tokenizer: Path | None = None  # defaults to the model directory
    trust_remote_code: bool = False  # run the Python code the model/tokenizer ships (Kimi's)
    # vLLM pass-through
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    shards_per_call: int = 4
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)
    # Streaming hand-off (eagle3_schemas.contract.stream): shards are trained on while extraction runs;
    # the run pauses while the shards on disk would exceed disk_budget bytes.
    stream: bool = False
    disk_budget: int | None = None
    # Stream the plan this many times, once per training epoch (re-extraction), so a trainer
    # that reclaims shards can still train several epochs.
    stream_epochs: int = 1
    # Signals that stop the run after the shard in flight is sealed (exit 5; rerun resumes):
    # SIGTERM is what Slurm and Kubernetes send before killing; SIGUSR1 for Slurm's --signal.
    preempt_signals: tuple[str, ...] = ("SIGTERM",)

    def __post_init__(self) -> None:
        problems = []
        try:
            parse_signals(self.preempt_signals, "preempt_signals")
        except ValueError as e:
            problems.append(str(e))
        if self.backend not in BACKENDS:
            problems.append(f"backend {self.backend!r}: expected one of {BACKENDS}")
        if self.storage_dtype not in STORAGE_DTYPES:
            problems.append(
                f"storage_dtype {self.storage_dtype!r}: expected one of {STORAGE_DTYPES}"
            )
        if self.compute_dtype not in COMPUTE_DTYPES:
            problems.append(
                f"compute_dtype {self.compute_dtype!r}: expected one of {COMPUTE_DTYPES}"
            )
        if not 0 <= self.rank < self.world_size:
            problems.append(f"rank {self.rank} must lie in [0, world_size={self.world_size})")
        if self.shard_mb <= 0:
            problems.append(f"shard_mb must be > 0, found {self.shard_mb}")
        if self.batch_tokens < 1:
            problems.append(f"batch_tokens must be >= 1, found {self.batch_tokens}")
        if self.max_samples is not None and self.max_samples < 0:
            problems.append(f"max_samples must be >= 0, found {self.max_samples}")
        if self.sample_seed is not None and self.max_samples is None:
            problems.append("sample_seed draws a random max_samples rows: set max_samples too")
        if self.sample_seed is not None and self.sample_seed < 0:
            problems.append(f"sample_seed must be >= 0, found {self.sample_seed}")
        if self.shards_per_call < 1:
            problems.append(f"shards_per_call must be >= 1, found {self.shards_per_call}")
        if self.disk_budget is not None and not self.stream:
            problems.append("disk_budget bounds a stream: set stream too")
        if self.disk_budget is not None and self.disk_budget < 1:
            problems.append(f"disk_budget must be > 0 bytes, found {self.disk_budget}")
        if self.stream_epochs < 1 or (self.stream_epochs > 1 and not self.stream):
            problems.append(
                f"stream_epochs {self.stream_epochs}: re-extraction per epoch is for a stream "
                "(>= 1, with stream)"
            )
        if self.stream and self.world_size != 1:
            problems.append(
                "stream: one producer per stream (world_size 1; TP/PP inside it); merge ranks "
                "of an offline extraction instead"
            )
        if problems:
            raise ConfigError("invalid extraction config: " + "; ".join(problems))

    @property
    def tokenizer_dir(self) -> Path:
        return self.tokenizer or self.model

    def with_layer_ids(self, ids: list[int]) -> ExtractConfig:
        return dataclasses.replace(self, aux_layer_ids=tuple(ids))

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for key, value in out.items():
            if isinstance(value, Path):
                out[key] = str(value)
        out["aux_layer_ids"] = list(self.aux_layer_ids) if self.aux_layer_ids else None
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ExtractConfig:
        kwargs = dict(obj)
        for key in ("model", "tokenized", "out", "tokenizer"):
            if kwargs.get(key) is not None:
                kwargs[key] = Path(kwargs[key])
        if kwargs.get("aux_layer_ids") is not None:
            kwargs["aux_layer_ids"] = tuple(kwargs["aux_layer_ids"])
        return cls(**kwargs)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True)
