"""The draft's construction for a run: the model with the target's frozen tensors (and
draft.init_from's weights), what makes its step fast on the device, the optimizer and the
learning-rate schedule.

The trainer builds its run from these, and preflight's dry run builds the same model, so
neither imports the other.
"""

from __future__ import annotations

import logging
import math

import torch

from eagle3_train.arch import DraftArch
from eagle3_train.config import Config
from eagle3_train.init_from import InitFromError, compatibility_problems, load_into, read_init_draft
from eagle3_train.inputs import RunInputs, load_target_head
from eagle3_train.loss import compile_kl_chunk
from eagle3_train.model import Eagle3Draft

log = logging.getLogger(__name__)


def build_model(inputs: RunInputs, arch: DraftArch, seed: int) -> Eagle3Draft:
    torch.manual_seed(seed)
    model = Eagle3Draft(arch)
    head = load_target_head(inputs.dataset.root, inputs.vocab.target_ids)
    model.load_target_head(head["embed_tokens"], head["norm"], head["lm_head_rows"])
    if inputs.config.draft.init_from:
        init_from_draft(model, inputs, arch)
    model.lm_head.weight.requires_grad_(inputs.config.draft.train_lm_head)
    return model


def init_from_draft(model: Eagle3Draft, inputs: RunInputs, arch: DraftArch) -> None:
    """draft.init_from: the published draft's weights over the fresh start (checked again here,
    so a run with preflight off is refused too), with the LM-head rows it carried reported."""
    d = inputs.config.draft
    init = read_init_draft(d.init_from)
    where = str(inputs.dataset.header_file)
    problems = compatibility_problems(
        init, arch, inputs.aux_layer_ids, inputs.vocab.d2t, d.remap_vocab, where
    )
    if problems:
        raise InitFromError("; ".join(problems))
    counts = load_into(model, init, inputs.vocab.d2t)
    log.info(
        "draft.init_from %s: %d tensors loaded; LM head: %d rows carried over, %d from the "
        "target's rows",
        d.init_from,
        counts["tensors"],
        counts["lm_head_rows_carried"],
        counts["lm_head_rows_from_target"],
    )


def speed_up(model: Eagle3Draft, config: Config, accelerator) -> None:
    """What makes the step fast on the device, applied from outside the model: the frozen
    target weights in bf16 under bf16 training, and (train.compile) compiled decoder layers
    and loss chunk body."""
    # (not when the export copies the embedding: it keeps the target's own values)
    if accelerator.mixed_precision == "bf16" and not config.export.include_embeddings:
        model.store_frozen_as(torch.bfloat16)
    if compile_enabled(config.train.compile, accelerator.device):
        for layer in model.layers:
            layer.compile()  # in place: parameter names (checkpoints, export) stay
        compile_kl_chunk(True)


def compile_enabled(setting: str, device: torch.device) -> bool:
    return setting == "always" or (setting == "auto" and device.type == "cuda")


def make_optimizer(model: Eagle3Draft, config: Config, accelerator) -> torch.optim.Optimizer:
    t = config.train
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    plugin = accelerator.state.deepspeed_plugin
    offload = plugin is not None and (
        plugin.deepspeed_config.get("zero_optimization", {})
        .get("offload_optimizer", {})
        .get("device")
        in ("cpu", "nvme")
    )
    if offload:
        # ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's own Adam kernel.
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(
            groups, lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps, adamw_mode=True
        )
    # CUDA: one fused kernel for the whole update (no per-parameter launches, no host sync)
    fused = accelerator.device.type == "cuda"
    return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps, fused=fused)


def lr_lambda(config: Config, total_steps: int):
    t = config.train

    def factor(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "constant":
            return 1.0
        span = max(1, total_steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if t.schedule == "cosine" else 1 - progress
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * shape

    return factor
