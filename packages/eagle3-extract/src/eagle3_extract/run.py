"""One extraction run, top to bottom: resolve, preflight, plan, resume, capture, finalize.

Backends differ only in how states of a planned shard are captured: the transformers backend
returns them here and the writer packs them; the vLLM backend's KV connector packs them inside
the engine with the same writer. Everything else (plan, resume, manifest, header) is shared.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from eagle3_extract import preflight
from eagle3_extract.backends.hf import HFBackend, run_shards_hf
from eagle3_extract.backends.vllm_backend import run_shards_vllm
from eagle3_extract.backends.vllm_introspect import introspect, model_findings
from eagle3_extract.config import MODEL_EXPECTED, ExtractConfig, default_aux_layer_ids
from eagle3_extract.context import RunContext
from eagle3_extract.plan import (
    bytes_per_token,
    epoch_plan,
    plan_shards,
    shard_tokens_for,
)
from eagle3_extract.samples import read_tokenized
from eagle3_extract.streaming import DiskGate
from eagle3_extract.target import read_target, read_target_head
from eagle3_extract.workdir import WorkDir, cleanup_finished, is_complete, partial_dir
from eagle3_schemas.contract.header import Header, make_header
from eagle3_schemas.contract.lineage import fingerprint_artifact, fingerprint_model_dir
from eagle3_schemas.contract.paths import (
    check_input_artifact,
    check_input_dir,
    check_output,
    check_output_artifact,
    describe_artifact,
    refuse,
)
from eagle3_schemas.contract.stream import Fragment, stream_section
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.io.diskspace import disk_full, is_disk_full
from eagle3_schemas.layouts.conversations import describe_selection
from eagle3_schemas.layouts.remote_code import check_trust, remote_code_record
from eagle3_schemas.runtime.signals import StopSignals

log = logging.getLogger(__name__)


class ExtractionError(RuntimeError):
    pass


def check_paths(config: ExtractConfig) -> None:
    """Refuse bad paths before anything is read or created, naming the ``--flag``.

    ``--out`` may hold a complete dataset (the run is then a no-op) and ``OUT.partial`` a killed
    run (resumed); anything else already under ``--out`` belongs to someone else.
    """
    check_input_dir(config.model, "--model", MODEL_EXPECTED, must_contain=("config.json",))
    check_input_artifact(config.tokenized, "tokenized", "--tokenized")
    if config.tokenizer is not None:
        check_input_dir(config.tokenizer, "--tokenizer", "a tokenizer directory")
    # vLLM loads the tokenizer and the model's config; transformers here only the model.
    check_trust(
        config.model, config.trust_remote_code, "all" if config.backend == "vllm" else "model"
    )
    if config.backend == "vllm" and config.tokenizer is not None:
        check_trust(config.tokenizer, config.trust_remote_code, "tokenizer")
    check_output_artifact(config.out, "hidden_states", "--out", may_exist=True)
    if config.out.exists() and not is_complete(config.out):
        refuse(
            "--out",
            config.out,
            "exists and is not a complete hidden-state dataset (no dataset.json)",
            f"{describe_artifact('hidden_states')} not there yet; a killed run resumes from "
            f"{partial_dir(config.out)}, never into --out itself",
        )
    work = partial_dir(config.out)
    check_output(work, "--out", "the run's work directory", directory=True, may_exist=True)


def resolve(config: ExtractConfig) -> RunContext:
    target = read_target(config.model)
    tokenized = read_tokenized(config.tokenized, config.max_samples, config.sample_seed)
    aux = (
        list(config.aux_layer_ids)
        if config.aux_layer_ids
        else default_aux_layer_ids(target.num_hidden_layers)
    )
    per_token = bytes_per_token(len(aux), target.hidden_size, config.storage_dtype)
    plans = plan_shards(
        tokenized.samples,
        config.rank,
        config.world_size,
        shard_tokens_for(config.shard_mb, per_token),
    )
    if config.stream_epochs > 1:  # re-extraction per training epoch: the plan once per epoch
        plans = [epoch_plan(p, e) for e in range(config.stream_epochs) for p in plans]
    recorded = tokenized.header.lineage.get("tokenizer_fingerprint")
    lineage = {
        "target_fingerprint": fingerprint_model_dir(config.model),
        "tokenizer_fingerprint": recorded,
        "tokenized_fingerprint": fingerprint_artifact(config.tokenized),
        "aux_layer_ids": aux,
        **remote_code_record(config.model, config.trust_remote_code, "all"),
    }
    return RunContext(config.with_layer_ids(aux), target, tokenized, aux, plans, lineage)


def build_header(ctx: RunContext, fragments: dict[str, Fragment], seconds: float) -> Header:
    rows = [r for p in ctx.plans for r in fragments[p.name].rows]
    rejected = [r for p in ctx.plans for r in fragments[p.name].rejected]
    return _header(
        ctx,
        len(rows),
        sum(r.num_tokens for r in rows),
        rejected,
        {"seconds_last_attempt": round(seconds, 3)},
    )


def stream_header(ctx: RunContext) -> Header:
    """The header a stream's consumer reads before any shard: planned totals (rejections, if
    any, show in the fragments) and the shard plan."""
    c = ctx.config
    section = stream_section(
        [(p.name, [(s.sample_id, s.num_tokens) for s in p.samples]) for p in ctx.plans],
        bytes_per_token(len(ctx.aux_layer_ids), ctx.target.hidden_size, c.storage_dtype),
        c.disk_budget,
        c.stream_epochs,
    )
    one_pass = ctx.plans[: len(ctx.plans) // c.stream_epochs]  # the dataset, once
    samples = sum(len(p.samples) for p in one_pass)
    return _header(ctx, samples, sum(p.num_tokens for p in one_pass), [], {}, stream=section)


def _header(
    ctx: RunContext,
    num_samples: int,
    num_tokens: int,
    rejected: list[dict[str, Any]],
    extraction: dict[str, Any],
    **extra: Any,
) -> Header:
    c = ctx.config
    return make_header(
        "hidden_states",
        ctx.lineage,
        target=ctx.target.header_target(),
        aux_layer_ids=ctx.aux_layer_ids,
        last_hidden_state_layer_id=ctx.target.num_hidden_layers,
        storage_dtype=c.storage_dtype,
        compute_dtype=ctx.compute_dtype,
        backend=c.backend,
        num_samples=num_samples,
        num_tokens=num_tokens,
        shard_index=c.rank,
        num_shards_total=c.world_size,
        rejected_samples=rejected,
        # The tokenized set's record of whose answers these are (the draft's card says it).
        **({"answers": answers} if (answers := ctx.tokenized.header.fields.get("answers")) else {}),
        extraction={
            "assigned_samples": sum(len(p.samples) for p in ctx.plans),
            "shards_planned": len(ctx.plans),
            **extraction,
            "max_samples": c.max_samples,
            # Not a field of schema v1 (which allows extra header fields): which rows were taken.
            "sample_seed": c.sample_seed,
            "selection": describe_selection(c.max_samples, c.sample_seed),
        },
        **extra,
    )


def run(config: ExtractConfig, hf_backend: HFBackend | None = None) -> dict[str, Any]:
    """Extract; returns a summary. Idempotent: a complete dataset is left as is.

    ``hf_backend``: an already built transformers backend to capture with (for a model object
    built in memory, or a capture variant); by default one is loaded from ``config.model``.
    """
    check_paths(config)
    start = time.perf_counter()
    if is_complete(config.out):
        cleanup_finished(config.out)
        log.info("%s is already complete; nothing to do", config.out)
        return {"out": str(config.out), "status": "already complete"}
    ctx = resolve(config)
    work = WorkDir(config.out)
    resuming = work.resumable(ctx.identity())
    done = work.completed(ctx.plans) if resuming else {}
    pending = [p for p in ctx.plans if p.name not in done]
    log.info(
        "%s: %d of %d shards to do (%s)",
        config.out,
        len(pending),
        len(ctx.plans),
        "resuming" if resuming else "new run",
    )
    if config.preflight:  # before anything is created on disk
        preflight.raise_on_errors(preflight.static_checks(ctx, pending))
    work.prepare(ctx.identity())
    gate = None
    if config.stream:
        gate = DiskGate(
            work.root,
            config.disk_budget,
            bytes_per_token(len(ctx.aux_layer_ids), ctx.target.hidden_size, config.storage_dtype),
        )
        step = config.shards_per_call if config.backend == "vllm" else 1
        gate.check_fits([pending[i : i + step] for i in range(0, len(pending), step)])
        ctx.make_room = gate.wait_for_room
        work.open_stream(stream_header(ctx), read_target_head(ctx.target))
    tokens_done = 0
    with StopSignals(config.preempt_signals, "preempt_signals") as stop:
        ctx.should_stop = lambda: stop.requested
        if pending:
            if config.backend == "hf":
                tokens_done = run_shards_hf(ctx, work, pending, hf_backend)
            else:
                tokens_done = run_shards_vllm(ctx, work, pending)
    capture_seconds = time.perf_counter() - start
    sealed = len(work.completed(ctx.plans)) if stop.received is not None else 0
    if stop.received is not None and sealed < len(ctx.plans):
        summary = {
            "out": str(work.root),
            "status": "preempted",
            "signal": stop.received.name,
            "shards_sealed": sealed,
            "shards": len(ctx.plans),
            "tokens_this_attempt": tokens_done,
            "seconds": round(capture_seconds, 3),
        }
        log.warning(
            "preempted by %s: %d of %d shards sealed, none in flight; rerun the same command "
            "to resume",
            stop.received.name,
            sealed,
            len(ctx.plans),
        )
        return summary
    if gate is not None:
        summary = {
            "out": str(work.root),
            "status": "stream complete",
            "shards": len(ctx.plans),
            "tokens_this_attempt": tokens_done,
            "seconds": round(capture_seconds, 3),
            "paused_seconds": round(gate.paused_seconds, 3),
            "peak_shard_bytes_seen": gate.peak_bytes,
            "disk_budget": config.disk_budget,
        }
        work.end_stream(summary)
        log.info("stream done: %s", summary)
        return summary
    fragments = work.completed(ctx.plans)
    header = build_header(ctx, fragments, capture_seconds)
    try:
        finished = work.finish(ctx.plans, fragments, header, read_target_head(ctx.target))
    except Exception as e:  # (atomic writes: the shards stay, the rerun finishes again)
        if not is_disk_full(e):
            raise
        raise disk_full(work.root, "the manifest, header and target head", None, e) from e
    if config.validate_output:  # before publishing: an invalid dataset never gets the final name
        violations = validate(finished)
        if violations:
            raise ExtractionError(
                f"{finished}: the written dataset does not validate (left unpublished):\n"
                + "\n".join(str(v) for v in violations[:20])
            )
    out = work.publish()
    seconds = time.perf_counter() - start
    summary = {
        "out": str(out),
        "status": "complete",
        "samples": header.fields["num_samples"],
        "tokens": header.fields["num_tokens"],
        "rejected": len(header.fields["rejected_samples"]),
        "tokens_this_attempt": tokens_done,
        "seconds": round(seconds, 3),
    }
    log.info("extraction done: %s", summary)
    return summary


def preflight_only(config: ExtractConfig) -> list[preflight.Finding]:
    """The checks ``run`` does first, plus the backend's library check, without extracting."""
    check_paths(config)
    ctx = resolve(config)
    findings = preflight.static_checks(ctx, ctx.plans)
    first = next((p.samples[0] for p in ctx.plans), None)
    if config.backend == "hf":
        if first is not None:
            backend = HFBackend(
                config.model,
                ctx.layer_ids,
                dtype=ctx.compute_dtype,
                trust_remote_code=config.trust_remote_code,
            )
            problems = backend.self_check(first)
            findings += [preflight.Finding("error", "transformers dry run", p) for p in problems]
            if not problems:
                findings.append(
                    preflight.Finding(
                        "ok", "transformers dry run", "hooks see the pre-norm residual stream"
                    )
                )
    else:
        findings += introspect()
        findings += model_findings(
            ctx.target.architecture, config.pipeline_parallel_size, ctx.layer_ids
        )
    return findings
