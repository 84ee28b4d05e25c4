"""Verify before run: each check is a small function returning findings.

Runs by default before training and alone with ``--preflight``. A finding of level "error"
stops the run; every message names both sides of a mismatch (which file or config key says
what). Order: schema validation → lineage and shapes → resume compatibility → library
interfaces (introspection) → one real forward/backward → memory and disk estimates.

The checks by what they look at: artifacts.py (the inputs, their lineage, resume, init_from),
environment.py (third-party interfaces, the CUDA driver), device.py (the dry run, memory and
disk, the flash kernel); report.py holds the findings.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from eagle3_train.components.build import compile_enabled
from eagle3_train.data.inputs import RunInputs
from eagle3_train.model.arch import DraftArch
from eagle3_train.preflight.artifacts import (
    check_draft_shape,
    check_export_format,
    check_export_vocab,
    check_init_from,
    check_lineage,
    check_resume,
    check_schemas,
    check_stream,
)
from eagle3_train.preflight.device import check_attention_kernel, check_dry_run, check_memory
from eagle3_train.preflight.environment import check_cuda_driver, check_interfaces
from eagle3_train.preflight.report import Finding, PreflightError, PreflightReport

__all__ = ["Finding", "PreflightError", "PreflightReport", "run_preflight"]


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
    report.findings += check_resume(inputs, resume_from)
    report.findings += check_init_from(inputs, arch)
    report.findings += check_export_format(inputs, arch)
    report.findings += check_export_vocab(arch)
    report.findings += check_cuda_driver()
    muon_clip = cfg.train.optimizer == "muon" and cfg.train.max_grad_norm > 0
    report.findings += check_interfaces(arch, plugin is not None, offload, muon_clip)
    if full and not report.errors:
        device = accelerator.device if accelerator is not None else torch.device("cpu")
        mixed = getattr(accelerator, "mixed_precision", "no") if accelerator else "no"
        compiled = compile_enabled(cfg.train.compile, device)
        report.findings += check_attention_kernel(arch, device, mixed, compiled)
        dry_findings, dry = check_dry_run(inputs, arch, device)
        report.findings += dry_findings
        world = accelerator.num_processes if accelerator is not None else 1
        report.findings += check_memory(
            inputs, arch, device, world, int(zero.get("stage", 0) or 0), dry
        )
    report.seconds = time.perf_counter() - start
    return report
