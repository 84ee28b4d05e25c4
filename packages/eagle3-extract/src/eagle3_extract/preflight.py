"""Verify before run: each check is a small function returning findings; errors stop the run.

Runs by default before extraction (``run``) and alone (``preflight``): the tokenized input
validates, its tokenizer lineage matches the target's tokenizer, the layer ids are valid for
the target, the disk has room, and the backend library behaves as the code relies on (checked
by introspection and a one-sample dry run; see the backends).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_extract.config import ConfigError, check_layer_ids
from eagle3_extract.context import RunContext
from eagle3_extract.plan import SAMPLE_META_BYTES, ShardPlan, bytes_per_token
from eagle3_extract.samples import Tokenized
from eagle3_extract.target import TargetInfo, head_bytes, transformers_refusal
from eagle3_schemas.contract.lineage import fingerprint_tokenizer_dir
from eagle3_schemas.contract.validate import validate

log = logging.getLogger(__name__)

# Keep this share of the free space untouched: other writers share the disk.
DISK_HEADROOM = 0.05


@dataclass(frozen=True)
class Finding:
    level: str  # "ok" | "warning" | "error"
    check: str
    message: str

    def __str__(self) -> str:
        return f"[{self.level:7}] {self.check}: {self.message}"


class PreflightError(RuntimeError):
    def __init__(self, findings: Sequence[Finding]) -> None:
        self.findings = list(findings)
        errors = [f for f in findings if f.level == "error"]
        super().__init__(
            f"preflight failed ({len(errors)} error(s)):\n" + "\n".join(str(f) for f in errors)
        )


def check_tokenized(path: Path) -> list[Finding]:
    violations = validate(path)
    if violations:
        shown = "\n  ".join(str(v) for v in violations[:10])
        return [Finding("error", "tokenized input", f"{len(violations)} violation(s):\n  {shown}")]
    return [Finding("ok", "tokenized input", f"{path} validates (schema tokenized)")]


def check_backend(backend: str, target: TargetInfo) -> list[Finding]:
    refusal = transformers_refusal(target) if backend == "hf" else None
    if refusal:
        return [Finding("error", "backend", refusal)]
    return []


def check_layers(target: TargetInfo, aux_layer_ids: Sequence[int]) -> list[Finding]:
    try:
        check_layer_ids(list(aux_layer_ids), target.num_hidden_layers)
    except ConfigError as e:
        return [Finding("error", "layer ids", str(e))]
    n = target.num_hidden_layers
    message = (
        f"aux {list(aux_layer_ids)} + last id {n} (pre-norm) of a {n}-layer {target.architecture}"
    )
    return [Finding("ok", "layer ids", message)]


def check_vocab(target: TargetInfo, tokenized: Tokenized) -> list[Finding]:
    vocab = tokenized.header.fields.get("vocab_size")
    if not isinstance(vocab, int) or vocab > target.vocab_size:
        message = (
            f"tokenized header vocab_size {vocab!r} exceeds the target's vocab_size "
            f"{target.vocab_size}: the samples were tokenized for another model"
        )
        return [Finding("error", "vocabulary", message)]
    return [Finding("ok", "vocabulary", f"tokenizer {vocab} <= target {target.vocab_size} ids")]


def check_tokenizer_lineage(tokenizer_dir: Path, tokenized: Tokenized) -> list[Finding]:
    recorded = tokenized.header.lineage.get("tokenizer_fingerprint")
    try:
        actual = fingerprint_tokenizer_dir(tokenizer_dir)
    except FileNotFoundError:
        message = (
            f"{tokenizer_dir} holds no tokenizer files; cannot check that {tokenized.path} was "
            "tokenized with the target's tokenizer (pass --tokenizer DIR)"
        )
        return [Finding("warning", "tokenizer lineage", message)]
    if actual != recorded:
        message = (
            f"{tokenized.path} records tokenizer_fingerprint {recorded} but the target's "
            f"tokenizer {tokenizer_dir} is {actual}: the samples were tokenized with another "
            "tokenizer"
        )
        return [Finding("error", "tokenizer lineage", message)]
    message = f"tokenized with {tokenizer_dir} ({actual[:19]}...)"
    return [Finding("ok", "tokenizer lineage", message)]


def disk_need(
    target: TargetInfo, n_aux: int, storage_dtype: str, num_tokens: int, num_samples: int
) -> int:
    per_token = bytes_per_token(n_aux, target.hidden_size, storage_dtype)
    return per_token * num_tokens + SAMPLE_META_BYTES * num_samples + head_bytes(target)


def free_space(out: Path) -> tuple[Path, int]:
    """(the nearest existing folder of ``out``, its free bytes)."""
    probe = out
    while not probe.exists():
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def check_disk(out: Path, need: int, num_tokens: int) -> list[Finding]:
    probe, free = free_space(out)
    usable = int(free * (1 - DISK_HEADROOM))
    text = f"need {need / 2**30:.3f} GiB for {num_tokens} tokens, {free / 2**30:.1f} GiB free at {probe}"
    if need > usable:
        return [Finding("error", "disk", text + f" (keeping {DISK_HEADROOM:.0%} headroom)")]
    return [Finding("ok", "disk", text)]


def check_cuda_driver(who: str = "torch") -> list[Finding]:
    """On a host with an NVIDIA driver: does it support the CUDA release torch (and vLLM,
    built on the same torch) needs? Nothing on a machine without one."""
    from eagle3_schemas.runtime.cuda_driver import check_this_host

    verdict = check_this_host(who)
    return [] if verdict is None else [Finding(verdict[0], "cuda_driver", verdict[1])]


def static_checks(ctx: RunContext, plans: Sequence[ShardPlan]) -> list[Finding]:
    """Everything that needs no model weights loaded, for the shards ``plans`` still to do."""
    config, target, tokenized = ctx.config, ctx.target, ctx.tokenized
    tokens = sum(p.num_tokens for p in plans)
    samples = sum(len(p.samples) for p in plans)
    need = disk_need(target, len(ctx.aux_layer_ids), config.storage_dtype, tokens, samples)
    return [
        *check_tokenized(config.tokenized),
        *check_backend(config.backend, target),
        *check_layers(target, ctx.aux_layer_ids),
        *check_vocab(target, tokenized),
        *check_tokenizer_lineage(config.tokenizer_dir, tokenized),
        *check_disk(config.out, need, tokens),
        *check_cuda_driver(),
    ]


def raise_on_errors(findings: Sequence[Finding]) -> None:
    for finding in findings:
        (log.error if finding.level == "error" else log.info)("preflight %s", finding)
    if any(f.level == "error" for f in findings):
        raise PreflightError(findings)
