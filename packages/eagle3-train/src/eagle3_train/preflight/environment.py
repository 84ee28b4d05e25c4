"""Preflight of the environment: the third-party interfaces this trainer relies on, checked
by introspection, and the host's CUDA driver."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from eagle3_train.components import zero_clip
from eagle3_train.model.arch import DraftArch
from eagle3_train.preflight.report import Finding, ok

# ---------------------------------------------------------------------------------------
# Third-party interfaces this trainer relies on, checked by introspection


def _params(fn: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(fn).parameters)


def check_interfaces(
    arch: DraftArch, deepspeed: bool, offload: bool, muon_clip: bool = False
) -> list[Finding]:
    """The APIs this run calls, present. ``muon_clip``: Muon with train.max_grad_norm under
    DeepSpeed, whose clip before Newton–Schulz relies on DeepSpeed internals
    (components/zero_clip.py contract_problems): a DeepSpeed that renamed them is an error here,
    before the run."""
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
            if muon_clip:
                for problem in zero_clip.contract_problems():
                    need(False, f"train.optimizer: muon with train.max_grad_norm: {problem}")
        except ImportError as e:
            need(
                False,
                f"a DeepSpeed launch but deepspeed does not import ({e}); install eagle3-train[deepspeed]",
            )
    return out or ok("interfaces", f"{acc}, torch {torch.__version__}: every API used is present")


# ---------------------------------------------------------------------------------------


def check_cuda_driver() -> list[Finding]:
    """On a host with an NVIDIA driver: does it support the CUDA release torch was built for?
    (Too old, and torch reports no GPU: the run would go on on the CPU.) Nothing elsewhere."""
    from eagle3_schemas.runtime.cuda_driver import check_this_host

    verdict = check_this_host()
    return [] if verdict is None else [Finding(verdict[0], "cuda_driver", verdict[1])]
