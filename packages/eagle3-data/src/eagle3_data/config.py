"""Typed configuration of each eagle3-data command, with the checks that fail before any work."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eagle3_schemas.contract.paths import (
    check_input_artifact,
    check_input_dir,
    check_input_file,
    check_output,
    check_output_artifact,
    refuse,
)
from eagle3_schemas.layouts.remote_code import check_trust
from eagle3_schemas.runtime.signals import parse_signals

# Raw chat data ingest reads, besides a ``datasets`` directory saved with ``save_to_disk``.
RAW_SUFFIXES = (".jsonl", ".json", ".parquet")
RAW_EXPECTED = "a .jsonl, .json or .parquet file, or a datasets directory (save_to_disk)"
# What save_to_disk writes at the top of a Dataset / a DatasetDict directory.
DATASETS_MARKERS = ("state.json", "dataset_dict.json")


class ConfigError(ValueError):
    """A command was asked for something it cannot do; the message says what to change."""


def check_raw_input(path: Path) -> None:
    """A raw input ingest can read: refused up front, not after every other input was read."""
    if path.is_dir():
        if not any((path / marker).is_file() for marker in DATASETS_MARKERS):
            problem = f"is a directory without {' or '.join(DATASETS_MARKERS)}"
            refuse("input", path, problem, RAW_EXPECTED)
        return
    check_input_file(path, "input", RAW_EXPECTED, RAW_SUFFIXES)


def check_rejects(path: Path) -> None:
    """The rejects file is a side output, replaced on every run: it may exist, as a file."""
    check_output(path, "--rejects", "a JSONL file for rejected records", may_exist=True)


@dataclass(frozen=True)
class IngestConfig:
    inputs: list[Path]
    output: Path
    rejects: Path
    batch_rows: int = 2048  # rows per Parquet row group: bounds memory
    # keep only records whose field equals one of its values (every field named must match)
    keep: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def check(self) -> None:
        for path in self.inputs:
            check_raw_input(path)
        check_output_artifact(self.output, "conversations", "--out")
        check_rejects(self.rejects)


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 1024
    seed: int = 0


@dataclass(frozen=True)
class RegenerateConfig:
    conversations: Path
    output: Path
    rejects: Path
    model: str  # the served model name (endpoint) or model path (vLLM offline engine)
    endpoint: str | None = None  # OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1
    engine: str = "endpoint"  # "endpoint" | "vllm"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    concurrency: int = 8
    retries: int = 4
    timeout_s: float = 120.0
    backoff_s: float = 1.0
    limit: int | None = None  # regenerate only N conversations: the first N, or with sample_seed
    engine_args: dict[str, object] = field(default_factory=dict)  # passed to vllm.LLM(...) as is
    sample_seed: int | None = None  # with limit: N conversations drawn at random by id
    # Rendered into every request's prompt (e.g. Kimi's thinking=false: instant-mode answers).
    chat_template_kwargs: dict[str, object] = field(default_factory=dict)
    # Signals that stop the run once the answers in flight are in (journaled), exit 5, rerun
    # resumes: SIGTERM is what Slurm and Kubernetes send; SIGUSR1 for Slurm's --signal.
    preempt_signals: tuple[str, ...] = ("SIGTERM",)
    # The share of rows regenerated in thinking mode, drawn per row by a seeded hash of its id
    # (blake2b('{seed}:{id}')); None keeps each row's own mode (ingest's: 'thinking' where the
    # source carried reasoning, else 'instant') and chat_template_kwargs as given.
    thinking_fraction: float | None = None
    keep_length_cut: bool = False  # keep answers cut at max_tokens (counted) instead of rejecting

    @property
    def journal(self) -> Path:
        """Completed samples, appended as they finish: what makes the command resumable."""
        return self.output.with_name(self.output.name + ".journal.jsonl")

    def check(self) -> None:
        check_input_artifact(self.conversations, "conversations", "conversations")
        if self.engine == "endpoint" and not self.endpoint:
            raise ConfigError(
                "--endpoint URL is required with --engine endpoint (e.g. http://127.0.0.1:8000/v1)"
            )
        if self.engine not in ("endpoint", "vllm"):
            raise ConfigError(f"--engine {self.engine!r}: expected 'endpoint' or 'vllm'")
        try:
            parse_signals(self.preempt_signals, "--preempt-signals")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.concurrency < 1 or self.retries < 0:
            raise ConfigError("--concurrency must be >= 1 and --retries >= 0")
        if self.thinking_fraction is not None and not 0.0 <= self.thinking_fraction <= 1.0:
            raise ConfigError(
                f"--thinking-fraction must lie in [0, 1], got {self.thinking_fraction}"
            )
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit must be >= 1, got {self.limit}")
        if self.sample_seed is not None and self.limit is None:
            raise ConfigError("--sample-seed draws --limit N conversations: give --limit too")
        if self.engine == "vllm" and Path(self.model).is_dir():
            # The offline engine loads the model's tokenizer and config in this process.
            check_trust(self.model, bool(self.engine_args.get("trust_remote_code")), "all")
        # The output appears only when every sample is done; until then the run resumes from
        # its journal beside it, so an existing output means a finished run.
        check_output_artifact(self.output, "conversations", "--out")
        check_output(self.journal, "journal", "a JSONL journal file", may_exist=True)
        check_rejects(self.rejects)


@dataclass(frozen=True)
class TokenizeConfig:
    conversations: Path
    tokenizer: Path
    output: Path
    rejects: Path
    max_length: int = 2048
    workers: int = 2
    chunk_rows: int = 256  # conversations per worker task
    trust_remote_code: bool = False  # run the tokenizer's own Python code (Kimi's)

    def check(self) -> None:
        check_input_artifact(self.conversations, "conversations", "conversations")
        check_input_dir(
            self.tokenizer, "--tokenizer", "a Hugging Face tokenizer or model directory"
        )
        check_trust(self.tokenizer, self.trust_remote_code, "tokenizer")
        if self.max_length < 2 or self.workers < 1:
            raise ConfigError("--max-length must be >= 2 and --workers >= 1")
        check_output_artifact(self.output, "tokenized", "--out")
        check_rejects(self.rejects)


@dataclass(frozen=True)
class VocabConfig:
    tokenized: Path
    output: Path
    draft_vocab_size: int
    target_vocab_size: int | None = None  # default: the tokenized header's vocab_size

    def check(self) -> None:
        check_input_artifact(self.tokenized, "tokenized", "tokenized")
        if self.draft_vocab_size < 1:
            raise ConfigError("--draft-vocab-size must be >= 1")
        check_output_artifact(self.output, "vocab_map", "--out")
