"""Verify before run: each check is a small function returning findings.

Runs by default before training and alone with ``--preflight``. A finding of level "error"
stops the run; every message names both sides of a mismatch (which file or config key says
what). Order: schema validation → lineage and shapes → resume compatibility → library
interfaces (introspection) → one real forward/backward → memory and disk estimates.
"""

from __future__ import annotations

import inspect
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_train.arch import DraftArch
from eagle3_train.build import build_model
from eagle3_train.checkpoint import read_run_config, read_state, run_config_path
from eagle3_train.flash_attention import flash_self_check, resolve_attention
from eagle3_train.inputs import RunInputs, checkpoint_lineage


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning" | "ok"
    check: str
    message: str

    def __str__(self) -> str:
        return f"[{self.level.upper():7}] {self.check}: {self.message}"


class PreflightError(RuntimeError):
    """Preflight found errors; the message lists them all."""


@dataclass
class PreflightReport:
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    def render(self) -> str:
        lines = [f"preflight ({self.seconds:.1f} s): {len(self.errors)} error(s)"]
        lines += [f"  {f}" for f in self.findings]
        return "\n".join(lines)

    def raise_on_errors(self) -> None:
        if self.errors:
            raise PreflightError(
                "preflight found errors:\n" + "\n".join(f"  {f}" for f in self.errors)
            )


def _ok(check: str, message: str) -> list[Finding]:
    return [Finding("ok", check, message)]


# ---------------------------------------------------------------------------------------
# Inputs against their schemas


def check_schemas(inputs: RunInputs) -> list[Finding]:
    """Each input against its schema. A stream's header is checked here as a finished
    dataset's is; its shards are checked against their fragments as they are sealed."""
    from eagle3_schemas.stream import check_stream_header
    from eagle3_schemas.validate import validate

    out = []
    roles: list[tuple[str, Path]] = [("data.vocab_map", inputs.vocab.path)]
    if inputs.stream is None:
        roles.insert(0, ("data.hidden_states", inputs.dataset.root))
    else:
        header_problems = check_stream_header(inputs.stream.info)
        out += [Finding("error", "schema", f"data.hidden_states: {p}") for p in header_problems]
        if not header_problems:
            out += _ok(
                "schema", f"data.hidden_states: stream header {inputs.stream.root} validates"
            )
    for role, path in roles:
        problems = validate(path)
        for p in problems[:20]:
            out.append(Finding("error", "schema", f"{role}: {p}"))
        if len(problems) > 20:
            out.append(Finding("error", "schema", f"{role}: ... {len(problems) - 20} more"))
        if not problems:
            out += _ok("schema", f"{role} {path} validates")
    return out


# ---------------------------------------------------------------------------------------
# Lineage and shapes


def check_lineage(inputs: RunInputs, arch: DraftArch) -> list[Finding]:
    cfg, ds, vm = inputs.config, inputs.dataset, inputs.vocab
    ds_file = str(ds.header_file)
    ds_lineage = ds.header.get("lineage", {})
    out: list[Finding] = []

    def err(check: str, message: str) -> None:
        out.append(Finding("error", check, message))

    expected_ids = cfg.draft.aux_layer_ids
    if expected_ids is not None and expected_ids != ds.aux_layer_ids:
        err(
            "aux_layer_ids",
            f"dataset {ds_file} has aux_layer_ids {ds.aux_layer_ids} but config "
            f"draft.aux_layer_ids expects {expected_ids} (vLLM convention: id k = residual after "
            "k layers); re-extract with the expected ids or fix the config",
        )
    if ds_lineage.get("aux_layer_ids") not in (None, ds.aux_layer_ids):
        err(
            "aux_layer_ids",
            f"{ds_file}: header aux_layer_ids {ds.aux_layer_ids} but lineage.aux_layer_ids "
            f"{ds_lineage.get('aux_layer_ids')}",
        )
    n_layers = int(ds.header["target"]["num_hidden_layers"])
    bad = [i for i in ds.aux_layer_ids if not 0 <= i <= n_layers]
    if bad:
        err(
            "aux_layer_ids",
            f"{ds_file}: ids {bad} outside [0, {n_layers}] (target num_hidden_layers)",
        )
    for key, what in (
        ("tokenizer_fingerprint", "the vocab map was counted with another tokenizer"),
        ("tokenized_fingerprint", "the vocab map was counted over another tokenized dataset"),
    ):
        a, b = vm.lineage.get(key), ds_lineage.get(key)
        if a != b:
            err(
                "vocab_map",
                f"lineage {key}: vocab map {vm.path} has {a!r} but hidden-state dataset "
                f"{ds_file} has {b!r} ({what}: a foreign vocab map)",
            )
    if vm.t2d.shape[0] != ds.vocab_size:
        err(
            "vocab_map",
            f"vocab map {vm.path} t2d covers {vm.t2d.shape[0]} target ids but dataset "
            f"{ds_file} target.vocab_size is {ds.vocab_size}",
        )
    elif int(vm.target_ids.max(initial=0)) >= ds.vocab_size:
        err("vocab_map", f"vocab map {vm.path}: d2t maps past target vocab {ds.vocab_size}")

    tc = inputs.target_config
    if tc is not None:
        where = str(inputs.target_config_path)
        for key, theirs in (
            ("hidden_size", ds.hidden_size),
            ("num_hidden_layers", n_layers),
            ("vocab_size", ds.vocab_size),
        ):
            if key in tc and int(tc[key]) != int(theirs):
                err(
                    "target",
                    f"{key}: target config {where} has {tc[key]} but dataset {ds_file} "
                    f"target.{key} has {theirs}",
                )
        out += _check_target_files(inputs)
    elif cfg.target.name_or_path is None:
        out.append(
            Finding(
                "warning",
                "target",
                "neither target.path nor target.name_or_path is set: the export's "
                "speculators_config.verifier.name_or_path will be null, so `vllm serve <draft>` "
                "cannot find the target (serving the target with --speculative-config still "
                "works); set target.name_or_path to the target's hub id or path",
            )
        )
    if not any(f.level == "error" for f in out):
        out += _ok(
            "lineage",
            f"aux_layer_ids {ds.aux_layer_ids}, hidden {ds.hidden_size}, V_target "
            f"{ds.vocab_size}, V_draft {vm.draft_vocab_size}, tokenizer and tokenized set agree "
            f"(vocab map {vm.fingerprint[:19]}…); target norm eps {arch.target_rms_norm_eps}",
        )
    return out


def _check_target_files(inputs: RunInputs) -> list[Finding]:
    """Fingerprints of the target directory against the dataset's lineage, where present."""
    from eagle3_schemas.lineage import (
        TOKENIZER_FILES,
        fingerprint_model_dir,
        fingerprint_tokenizer_dir,
    )

    root = Path(inputs.config.target.path or ".")
    ds_lineage = inputs.dataset.header.get("lineage", {})
    out = []
    if list(root.glob("*.safetensors")):
        mine = fingerprint_model_dir(root)
        if mine != ds_lineage.get("target_fingerprint"):
            out.append(
                Finding(
                    "error",
                    "target",
                    f"target_fingerprint: target.path {root} is {mine} but dataset "
                    f"{inputs.dataset.header_file} lineage has "
                    f"{ds_lineage.get('target_fingerprint')!r} (states of another target)",
                )
            )
    if any((root / n).is_file() for n in TOKENIZER_FILES):
        mine = fingerprint_tokenizer_dir(root)
        if mine != ds_lineage.get("tokenizer_fingerprint"):
            out.append(
                Finding(
                    "error",
                    "target",
                    f"tokenizer_fingerprint: target.path {root} tokenizer is {mine} but dataset "
                    f"lineage has {ds_lineage.get('tokenizer_fingerprint')!r}",
                )
            )
    return out


# What vLLM's MLA attention serves: the latent + rope width its kernels take (CPU_MLA and
# FlashMLA: 576, DeepSeek-V3's and Kimi-K2.5's 512 + 64).
MLA_HEAD_SIZE = 576


def check_stream(inputs: RunInputs) -> list[Finding]:
    """A stream's disk budget against what this run keeps on disk at once: the window being
    trained, window 0 (validation) kept to the end, and the next window to train without
    waiting. Below the first two the producer and the trainer wait for each other forever."""
    stream, d, epochs = inputs.stream, inputs.config.data, inputs.config.train.epochs
    if stream is None:
        return []
    info, budget = stream.info, stream.info.disk_budget_bytes
    if info.epochs > 1 and info.epochs != epochs:
        return [
            Finding(
                "error",
                "stream",
                f"the stream is extracted once for each of {info.epochs} epochs "
                f"(eagle3-extract --epochs) but train.epochs is {epochs}",
            )
        ]
    if d.reclaim and epochs > 1 and info.epochs == 1:
        return [
            Finding(
                "error",
                "stream",
                f"data.reclaim with train.epochs={epochs}: epoch 2 needs shards epoch 1 "
                "reclaimed. Extract once per epoch (eagle3-extract run --stream --epochs "
                f"{epochs}), or pass over each window several times (data.window_passes) "
                "with train.epochs 1, or keep every shard (no --reclaim)",
            )
        ]
    if budget is None:
        return []
    sizes = [stream.planned_bytes(k) for k in stream.windows(0)]
    if not sizes:
        return []
    largest = max(sizes)
    kept = sizes[0] if d.validation_fraction > 0 else 0
    where = f"the stream's --disk-budget ({budget} bytes)"
    if not d.reclaim:
        total = sum(info.planned_bytes(s) for s in info.plan)  # every pass stays on disk
        if total > budget:
            return [
                Finding(
                    "error",
                    "stream",
                    f"{where} is smaller than the whole stream ({total} bytes planned) and "
                    "data.reclaim is off: the producer would pause forever. Pass --reclaim",
                )
            ]
        return _ok("stream", f"{where} holds the whole stream ({total} bytes planned)")
    if kept + largest > budget:
        return [
            Finding(
                "error",
                "stream",
                f"{where} cannot hold window 0 (kept for validation, {kept} bytes) and the "
                f"largest window ({largest} bytes, data.window_shards={d.window_shards}) at "
                "once: producer and trainer would wait for each other. Lower window_shards or "
                "raise the budget",
            )
        ]
    if kept + 2 * largest > budget:
        return [
            Finding(
                "warning",
                "stream",
                f"{where} holds window 0 and one window ({kept + largest} bytes) but not the "
                "next one as well: the trainer waits for the producer at every window",
            )
        ]
    return _ok("stream", f"{where} holds window 0, the window in training and the next one")


def check_draft_shape(arch: DraftArch) -> list[Finding]:
    """Shapes vLLM would refuse at load or serving time, refused before training."""
    if not arch.mla:
        return []
    problems = []
    if not arch.q_lora_rank:
        problems.append(
            "draft.q_lora_rank is unset: vLLM 0.32's MLA draft loader renames kv_a_proj_with_mqa "
            "into a fused q_a/kv_a projection that exists only with a q_lora_rank"
        )
    head = arch.kv_lora_rank + arch.qk_rope_head_dim
    if head != MLA_HEAD_SIZE:
        problems.append(
            f"kv_lora_rank + qk_rope_head_dim = {arch.kv_lora_rank} + {arch.qk_rope_head_dim} = "
            f"{head}: vLLM's MLA backends (CPU_MLA, FlashMLA) take {MLA_HEAD_SIZE} (512 + 64, "
            "the target's latent format, so the draft shares its KV-cache layout)"
        )
    if arch.hidden_act != "silu":
        problems.append(f"hidden_act {arch.hidden_act!r}: vLLM's MLA draft MLP is SiLU only")
    if arch.num_layers != 1:
        problems.append(f"num_layers {arch.num_layers}: vLLM's EAGLE-3 MLA draft is one layer")
    if problems:
        return [Finding("error", "draft shape", p) for p in problems]
    return _ok(
        "draft shape",
        f"MLA: {arch.num_attention_heads} heads, q_lora {arch.q_lora_rank}, latent "
        f"{arch.kv_lora_rank} + rope {arch.qk_rope_head_dim}, nope {arch.qk_nope_head_dim}, "
        f"v {arch.v_head_dim}",
    )


def check_resume(inputs: RunInputs, arch: DraftArch, resume_from: Path | None) -> list[Finding]:
    if resume_from is None:
        return []
    state = read_state(resume_from)
    saved = state.get("lineage") or {}
    now = checkpoint_lineage(inputs)
    out = []
    for key in ("hidden_states_fingerprint", "vocab_map_fingerprint", "aux_layer_ids"):
        if key in saved and saved[key] != now[key]:
            out.append(
                Finding(
                    "error",
                    "resume",
                    f"{key}: checkpoint {resume_from} was trained with {saved[key]!r} but this "
                    f"run's inputs give {now[key]!r} (set train.resume=never to start afresh)",
                )
            )
    run_yaml, run_config = run_config_path(resume_from), read_run_config(resume_from)
    if run_config is not None:
        old = run_config.get("draft", {})
        for key in ("num_layers", "norm_before_residual", "norm_before_fc", "norm_output"):
            if key in old and old[key] != getattr(inputs.config.draft, key):
                out.append(
                    Finding(
                        "error",
                        "resume",
                        f"draft.{key}: {run_yaml} has {old[key]!r} but this config has "
                        f"{getattr(inputs.config.draft, key)!r}",
                    )
                )
    return out or _ok("resume", f"checkpoint {resume_from} matches the inputs")


# ---------------------------------------------------------------------------------------
# Third-party interfaces this trainer relies on, checked by introspection


def _params(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def check_interfaces(arch: DraftArch, deepspeed: bool, offload: bool) -> list[Finding]:
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    out: list[Finding] = []

    def need(ok: bool, what: str) -> None:
        if not ok:
            out.append(Finding("error", "interfaces", what))

    acc = f"accelerate {accelerate.__version__}"
    init = _params(Accelerator.__init__)
    for name in (
        "cpu",
        "mixed_precision",
        "gradient_accumulation_steps",
        "log_with",
        "project_dir",
        "kwargs_handlers",
    ):
        need(name in init, f"{acc}: Accelerator() has no parameter {name!r}")
    for name in (
        "save_state",
        "load_state",
        "get_state_dict",
        "accumulate",
        "reduce",
        "clip_grad_norm_",
        "unwrap_model",
        "init_trackers",
        "log",
        "end_training",
        "free_memory",
        "wait_for_everyone",
    ):
        need(callable(getattr(Accelerator, name, None)), f"{acc}: Accelerator.{name} is missing")
    need(
        "backend" in _params(InitProcessGroupKwargs),
        f"{acc}: InitProcessGroupKwargs has no 'backend'",
    )
    need(
        "broadcast_buffers" in _params(DistributedDataParallelKwargs),
        f"{acc}: DistributedDataParallelKwargs has no 'broadcast_buffers'",
    )
    try:  # a builtin without a signature: call it the way dense_ttt_attention does
        x = torch.zeros(1, 1, 2, 4)
        torch.nn.functional.scaled_dot_product_attention(
            x, x, x, attn_mask=torch.ones(2, 2, dtype=torch.bool), scale=0.5
        )
    except (RuntimeError, TypeError) as e:
        need(
            False,
            f"torch {torch.__version__}: scaled_dot_product_attention(attn_mask=, scale=) fails ({e})",
        )
    need(
        hasattr(torch, "float8_e4m3fn"),
        f"torch {torch.__version__}: no float8_e4m3fn (fp8 storage)",
    )
    try:  # bf16 shards are read as uint16 and viewed: the view must exist
        torch.zeros(2, dtype=torch.uint16).view(torch.bfloat16)
    except (RuntimeError, TypeError) as e:
        need(False, f"torch {torch.__version__}: uint16 -> bfloat16 view fails ({e})")
    scaling = arch.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        need(rope_type in ROPE_INIT_FUNCTIONS, f"transformers: no RoPE init for {rope_type!r}")
    if deepspeed:
        try:
            import deepspeed as ds

            need(callable(getattr(ds, "initialize", None)), "deepspeed.initialize is missing")
            if offload:
                from deepspeed.ops.adam import DeepSpeedCPUAdam

                need(
                    "adamw_mode" in _params(DeepSpeedCPUAdam.__init__),
                    "DeepSpeedCPUAdam lacks adamw_mode",
                )
        except ImportError as e:
            need(
                False,
                f"a DeepSpeed launch but deepspeed does not import ({e}); install eagle3-train[deepspeed]",
            )
    return out or _ok("interfaces", f"{acc}, torch {torch.__version__}: every API used is present")


# ---------------------------------------------------------------------------------------
# One real batch, forward and backward


def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def check_dry_run(
    inputs: RunInputs, arch: DraftArch, device: torch.device
) -> tuple[list[Finding], dict[str, float]]:
    from eagle3_train.data import plan_epoch, split_indices
    from eagle3_train.loader import ShardReader, to_device

    cfg = inputs.config
    if inputs.stream is not None:  # the first window (waits for the producer to seal it)
        inputs.stream.open(0)
    train_idx, _ = split_indices(inputs.dataset, cfg.data.validation_fraction)
    plan = plan_epoch(
        inputs.dataset.num_tokens, train_idx, cfg.data.max_tokens_per_batch, cfg.train.seed, 0
    )
    if not plan:
        return [
            Finding(
                "error",
                "dry_run",
                f"{inputs.dataset.root}: no trainable sample (all shorter than 2 tokens or held out)",
            )
        ], {}
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    before = _rss_mib()
    model = build_model(inputs, arch, cfg.train.seed).to(device)
    batch = to_device(ShardReader(inputs.dataset).read(plan[0]), device)
    start = time.perf_counter()
    precision = cfg.train.mixed_precision
    autocast = cuda and precision in ("auto", "bf16")
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss, stats = model(
            batch["aux_hidden_states"],
            batch["last_hidden_state"],
            batch["input_ids"],
            batch["loss_mask"],
            batch["cu_seqlens"],
            cfg.train.ttt_steps,
            cfg.train.ttt_step_loss_decay,
            objective=cfg.train.objective,
        )
    after_forward = _rss_mib()  # activations are alive until backward frees them
    loss.backward()
    seconds = time.perf_counter() - start
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    peak = (
        torch.cuda.max_memory_allocated(device) / 2**20
        if cuda
        else max(after_forward - before, _rss_mib() - before, 0.0)
    )
    info = {"seconds": seconds, "peak_mib": peak, "tokens": float(batch["input_ids"].shape[0])}
    out = []
    if not torch.isfinite(loss):
        out.append(
            Finding(
                "error",
                "dry_run",
                f"loss is {float(loss.detach())} on the first batch (samples {plan[0][:3]}...)",
            )
        )
    if any(g is None for g in grads):
        out.append(Finding("error", "dry_run", "some trainable parameters received no gradient"))
    elif not all(bool(torch.isfinite(g).all()) for g in grads):
        out.append(Finding("error", "dry_run", "non-finite gradients on the first batch"))
    if int(stats[0, 2]) == 0:
        out.append(
            Finding(
                "warning", "dry_run", "the first batch has no scored token (loss_mask all zero?)"
            )
        )
    if not out:
        out += _ok(
            "dry_run",
            f"forward+backward of {int(info['tokens'])} tokens × {cfg.train.ttt_steps} TTT steps: "
            f"loss {float(loss.detach()):.4f}, {seconds:.2f} s, ~{peak:.0f} MiB",
        )
    del model, batch
    return out, info


def check_memory(
    inputs: RunInputs,
    arch: DraftArch,
    device: torch.device,
    world: int,
    zero_stage: int,
    dry: dict[str, float],
) -> list[Finding]:
    import psutil

    from eagle3_train.model import Eagle3Draft

    with torch.device("meta"):
        model = Eagle3Draft(arch)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) + sum(
        b.numel() for b in model.buffers()
    )
    # fp32 weights + grads + AdamW moments; ZeRO shards optimizer (1+), grads (2+), weights (3)
    per_param = (
        4 * (1 if zero_stage < 3 else 1 / world)
        + 4 * (1 if zero_stage < 2 else 1 / world)
        + 8 * (1 / world if zero_stage >= 1 else 1)
    )
    states = trainable * per_param + frozen * 4
    need = states + dry.get("peak_mib", 0.0) * 2**20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        where = f"GPU {device}"
    else:
        free = psutil.virtual_memory().available
        where = "host RAM"
    out = []
    gib = 2**30
    msg = (
        f"estimated {need / gib:.2f} GiB per process ({trainable / 1e6:.1f}M trainable, "
        f"{frozen / 1e6:.1f}M frozen, activations {dry.get('peak_mib', 0):.0f} MiB measured) "
        f"vs {free / gib:.2f} GiB free {where}"
    )
    procs_here = world if device.type != "cuda" else 1
    if need * procs_here > free:
        out.append(Finding("error", "memory", msg + f" × {procs_here} processes: does not fit"))
    elif need * procs_here > 0.8 * free:
        out.append(Finding("warning", "memory", msg + " (tight)"))
    else:
        out += _ok("memory", msg)
    ckpt = trainable * 12 * inputs.config.train.keep_checkpoints + trainable * 4 * 3
    parent = Path(inputs.config.output_dir)
    while not parent.exists():
        parent = parent.parent
    disk_free = shutil.disk_usage(parent).free
    if ckpt > disk_free:
        out.append(
            Finding(
                "error",
                "disk",
                f"checkpoints need ~{ckpt / gib:.2f} GiB, {disk_free / gib:.2f} GiB free under {parent}",
            )
        )
    return out


def check_attention_kernel(arch: DraftArch, device: torch.device, mixed: str) -> list[Finding]:
    """Where the flash path will run, it is first compared with the chunked reference on this
    device (values and gradients, with a negative control): a kernel of another torch that
    lays out its log-sum-exp differently stops the run here, not in a silently worse draft."""
    dtype = torch.bfloat16 if mixed == "bf16" else torch.float32
    if resolve_attention(arch.attention, device, dtype) != "flash":
        return []
    try:
        problems = flash_self_check(device)
    except (RuntimeError, TypeError) as e:  # an op missing or with another signature
        problems = [f"{type(e).__name__}: {e}"]
    return (
        [
            Finding(
                "error",
                "attention",
                f"draft.attention flash on {device} (torch {torch.__version__}) disagrees with the "
                f"chunked reference: {'; '.join(problems)}. Set draft.attention: chunked",
            )
        ]
        if problems
        else []
    )


# ---------------------------------------------------------------------------------------


def check_cuda_driver() -> list[Finding]:
    """On a host with an NVIDIA driver: does it support the CUDA release torch was built for?
    (Too old, and torch reports no GPU: the run would go on on the CPU.) Nothing elsewhere."""
    from eagle3_schemas.cuda_driver import check_this_host

    verdict = check_this_host()
    return [] if verdict is None else [Finding(verdict[0], "cuda_driver", verdict[1])]


def check_init_from(inputs: RunInputs, arch: DraftArch) -> list[Finding]:
    """draft.init_from: the starting draft fits this run (architecture, hidden size, aux layer
    ids, target vocabulary, draft vocabulary unless remap_vocab), before any step."""
    d = inputs.config.draft
    if not d.init_from:
        return []
    from eagle3_train.init_from import InitFromError, compatibility_problems, read_init_draft

    try:
        init = read_init_draft(d.init_from)
    except (InitFromError, OSError, KeyError, ValueError) as e:
        return [Finding("error", "init_from", str(e))]
    where = str(inputs.dataset.header_file)
    problems = compatibility_problems(
        init, arch, inputs.aux_layer_ids, inputs.vocab.d2t, d.remap_vocab, where
    )
    if problems:
        return [Finding("error", "init_from", p) for p in problems]
    shared = len(np.intersect1d(init.target_ids, inputs.vocab.target_ids))
    return _ok(
        "init_from",
        f"{d.init_from}: {init.architecture} draft fits; its LM head holds {shared} of this "
        f"run's {len(inputs.vocab.target_ids)} draft tokens",
    )


def run_preflight(
    inputs: RunInputs,
    arch: DraftArch,
    accelerator: Any,
    resume_from: Path | None,
    full: bool = True,
) -> PreflightReport:
    """All checks. ``full`` (the main process) adds schema validation, the dry run, memory."""
    start = time.perf_counter()
    report = PreflightReport()
    cfg = inputs.config
    plugin = getattr(accelerator.state, "deepspeed_plugin", None) if accelerator else None
    ds_cfg = plugin.deepspeed_config if plugin is not None else {}
    zero = ds_cfg.get("zero_optimization", {})
    offload = zero.get("offload_optimizer", {}).get("device") in ("cpu", "nvme")
    if full and cfg.train.validate_inputs:
        report.findings += check_schemas(inputs)
        if report.errors:  # later checks assume readable, well-formed inputs
            report.seconds = time.perf_counter() - start
            return report
    report.findings += check_lineage(inputs, arch)
    report.findings += check_stream(inputs)
    report.findings += check_draft_shape(arch)
    report.findings += check_resume(inputs, arch, resume_from)
    report.findings += check_init_from(inputs, arch)
    report.findings += check_cuda_driver()
    report.findings += check_interfaces(arch, plugin is not None, offload)
    if full and not report.errors:
        device = accelerator.device if accelerator is not None else torch.device("cpu")
        mixed = getattr(accelerator, "mixed_precision", "no") if accelerator else "no"
        report.findings += check_attention_kernel(arch, device, mixed)
        dry_findings, dry = check_dry_run(inputs, arch, device)
        report.findings += dry_findings
        world = accelerator.num_processes if accelerator is not None else 1
        report.findings += check_memory(
            inputs, arch, device, world, int(zero.get("stage", 0) or 0), dry
        )
    report.seconds = time.perf_counter() - start
    return report
