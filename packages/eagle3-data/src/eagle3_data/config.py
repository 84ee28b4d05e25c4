"""Typed configuration of each eagle3-data command, with the checks that fail before any work."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A command was asked for something it cannot do; the message says what to change."""


@dataclass(frozen=True)
class IngestConfig:
    inputs: list[Path]
    output: Path
    rejects: Path
    batch_rows: int = 2048  # rows per Parquet row group: bounds memory
    keep: dict[str, str] = field(
        default_factory=dict
    )  # keep only records whose field equals the value

    def check(self) -> None:
        for path in self.inputs:
            if not path.exists():
                raise ConfigError(f"input {path} does not exist")
        if self.output.exists():
            raise ConfigError(
                f"output {self.output} already exists; refusing to overwrite an artifact"
            )


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
    limit: int | None = None  # regenerate only the first N conversations
    engine_args: dict[str, object] = field(default_factory=dict)  # passed to vllm.LLM(...) as is

    @property
    def journal(self) -> Path:
        """Completed samples, appended as they finish: what makes the command resumable."""
        return self.output.with_name(self.output.name + ".journal.jsonl")

    def check(self) -> None:
        if not self.conversations.is_file():
            raise ConfigError(f"conversations {self.conversations} does not exist")
        if self.engine == "endpoint" and not self.endpoint:
            raise ConfigError(
                "--endpoint URL is required with --engine endpoint (e.g. http://127.0.0.1:8000/v1)"
            )
        if self.engine not in ("endpoint", "vllm"):
            raise ConfigError(f"--engine {self.engine!r}: expected 'endpoint' or 'vllm'")
        if self.concurrency < 1 or self.retries < 0:
            raise ConfigError("--concurrency must be >= 1 and --retries >= 0")
        if self.output.exists():
            raise ConfigError(
                f"output {self.output} already exists; refusing to overwrite an artifact"
            )


@dataclass(frozen=True)
class TokenizeConfig:
    conversations: Path
    tokenizer: Path
    output: Path
    rejects: Path
    max_length: int = 2048
    workers: int = 2
    chunk_rows: int = 256  # conversations per worker task

    def check(self) -> None:
        if not self.conversations.is_file():
            raise ConfigError(f"conversations {self.conversations} does not exist")
        if not self.tokenizer.is_dir():
            raise ConfigError(
                f"--tokenizer {self.tokenizer} is not a directory (a Hugging Face tokenizer or model directory)"
            )
        if self.max_length < 2 or self.workers < 1:
            raise ConfigError("--max-length must be >= 2 and --workers >= 1")
        if self.output.exists():
            raise ConfigError(
                f"output {self.output} already exists; refusing to overwrite an artifact"
            )


@dataclass(frozen=True)
class VocabConfig:
    tokenized: Path
    output: Path
    draft_vocab_size: int
    target_vocab_size: int | None = None  # default: the tokenized header's vocab_size

    def check(self) -> None:
        if not self.tokenized.is_file():
            raise ConfigError(f"tokenized {self.tokenized} does not exist")
        if self.draft_vocab_size < 1:
            raise ConfigError("--draft-vocab-size must be >= 1")
        if self.output.exists():
            raise ConfigError(
                f"output {self.output} already exists; refusing to overwrite an artifact"
            )
