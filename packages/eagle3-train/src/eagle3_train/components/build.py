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

from eagle3_train.components.sharded_muon import ShardedMuon
from eagle3_train.config.run_config import Config
from eagle3_train.data.inputs import RunInputs, load_target_head
from eagle3_train.export.init_from import (
    InitFromError,
    compatibility_problems,
    load_into,
    read_init_draft,
)
from eagle3_train.model.arch import DraftArch
from eagle3_train.model.draft import Eagle3Draft, compile_target_distribution
from eagle3_train.model.flash_attention import compile_flash_attention
from eagle3_train.model.loss import compile_kl_chunk

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
    and loss chunk body; (train.recompute) decoder layers recomputed in backward."""
    # (not when the export copies the embedding: it keeps the target's own values)
    if accelerator.mixed_precision == "bf16" and not config.export.include_embeddings:
        model.store_frozen_as(torch.bfloat16)
    if compile_enabled(config.train.compile, accelerator.device):
        for layer in model.layers:
            layer.compile()  # in place: parameter names (checkpoints, export) stay
        compile_kl_chunk(True)
        compile_flash_attention(True)
        compile_target_distribution(True)
    for layer in model.layers:  # memory rather than speed: recomputed in backward
        layer.recompute = config.train.recompute


def compile_enabled(setting: str, device: torch.device) -> bool:
    return setting == "always" or (setting == "auto" and device.type == "cuda")


def make_optimizer(model: Eagle3Draft, config: Config, accelerator) -> torch.optim.Optimizer:
    t = config.train
    plugin = accelerator.state.deepspeed_plugin
    if t.optimizer == "muon":
        cuda = accelerator.device.type == "cuda"
        if plugin is not None:
            # refused at start already (accelerator.py); this is the config DeepSpeed really got
            stage = plugin.deepspeed_config.get("zero_optimization", {}).get("stage")
            if stage != 2:
                raise ValueError(
                    f"train.optimizer: muon runs under DeepSpeed ZeRO-2 only, and this launch's "
                    f"DeepSpeed config has zero_optimization.stage {stage} (DEEPSPEED_REFUSED in "
                    "accelerator.py says why)"
                )
            return make_deepspeed_muon(model, config, fused=cuda)
        return make_muon(model, config, cuda=cuda)
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": t.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
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


# 2-D tensors that are rows of the vocabulary, not hidden maps: AdamW's under muon (Keller
# Jordan's Muon practice, as speculators' optimizers.py splits them)
VOCABULARY_ROWS = ("lm_head", "embed_tokens")


def muon_split(model: torch.nn.Module) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's, AdamW's) trained tensors: Muon takes the hidden 2-D matrices (both sides > 1:
    Newton–Schulz orthogonalises matrices, not vectors), AdamW the norms and vocabulary rows."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        matrix = p.dim() == 2 and min(p.shape) > 1
        hidden = not any(part in name for part in VOCABULARY_ROWS)
        (muon if matrix and hidden else adamw).append(p)
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """train.optimizer: muon — torch's Muon over the hidden matrices and AdamW over the rest,
    stepped as one optimizer, so Accelerate, the LR schedule, the non-finite skip and the
    checkpoint see one object. Both inner optimizers work on this one's param groups and state
    (the same dicts), so the schedule's lr reaches them and ``state_dict`` holds both."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        self.num_muon_groups = len(muon.param_groups)
        super().__init__(muon.param_groups + adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        self.muon.param_groups = self.param_groups[: self.num_muon_groups]
        self.adamw.param_groups = self.param_groups[self.num_muon_groups :]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict) -> None:  # type: ignore[override]
        super().load_state_dict(state_dict)  # replaces param_groups and state: share them again
        self._share()


def newton_schulz_dtype(chosen: str, cuda: bool) -> torch.dtype:
    """train.muon.newton_schulz_dtype: auto is bf16 where tensor cores multiply it (torch's
    choice) and float32 on a CPU, which emulates bf16 (sharded_muon)."""
    if chosen == "auto":
        return torch.bfloat16 if cuda else torch.float32
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[chosen]


def make_muon(model: Eagle3Draft, config: Config, cuda: bool) -> MuonWithAdamW:
    t, m = config.train, config.train.muon
    matrices, rest = muon_split(model)
    muon = ShardedMuon(  # torch's Muon, its Newton–Schulz shared out under DDP
        matrices,
        newton_schulz_dtype=newton_schulz_dtype(m.newton_schulz_dtype, cuda),
        lr=m.lr if m.lr is not None else t.lr,
        momentum=m.momentum,
        weight_decay=m.weight_decay,
        ns_steps=m.ns_steps,
        adjust_lr_fn=m.adjust_lr_fn,
    )
    adamw = torch.optim.AdamW(
        rest,
        lr=t.lr,
        betas=tuple(t.betas),
        eps=t.adam_eps,
        weight_decay=m.adamw_weight_decay,
        fused=cuda,
    )
    return MuonWithAdamW(muon, adamw)


def deepspeed_muon_lr_ratio(adjust_lr_fn: str, rows: int, cols: int) -> float:
    """torch.optim.Muon's step size over DeepSpeed's, for a (rows, cols) matrix. torch steps by
    lr x adjust_lr_fn's factor (torch/optim/_muon.py ``_adjust_lr``); DeepSpeed multiplies the
    orthogonalised update by Keller Jordan's sqrt(max(1, rows/cols)) whatever was asked
    (zero/muon/original_muon.py ``_aspect_ratio_scale``) and steps by the group's lr."""
    keller = math.sqrt(max(1.0, rows / cols))
    wanted = 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else keller
    return wanted / keller


def make_deepspeed_muon(model: Eagle3Draft, config: Config, fused: bool) -> torch.optim.Optimizer:
    """train.optimizer: muon under DeepSpeed ZeRO-2: DeepSpeed's own MuonWithAuxAdam, because
    ZeRO's gradient partitioning gathers each ``use_muon`` matrix whole and orthogonalises it
    before the flat partitions reach the optimizer (zero/stage_1_and_2.py get_flat_partition).
    Set up so that its step is make_muon's (checked in tests/test_muon_zero.py):

    - one Muon group per matrix shape, its lr x deepspeed_muon_lr_ratio: DeepSpeed's Keller
      scale times that ratio is torch's adjust_lr_fn scale; its weight decay / the ratio, as
      DeepSpeed decays by the group's lr where torch decays by the unadjusted one;
    - ns_method "standard": the quintic iteration with torch's coefficients, in bf16 as torch's,
      unfused (measured on a run's momentum buffers: 3-23 % off torch's, as far as torch's own
      is from itself on the same matrix rescaled by 1-3 %). DeepSpeed's default "gram" (X Xᵀ
      in fp16 with a restart) measured as close, but is not the same iteration;
    - momentum, Nesterov (DeepSpeed's is always on, as make_muon's) and 5 Newton–Schulz steps
      (ZeRO passes no ns_steps: train.muon.ns_steps is refused otherwise, accelerator.py);
    - torch's AdamW over the rest, with make_muon's settings.

    The LR schedule stays ours: a LambdaLR over these groups scales each group's lr, ratio kept.
    Not compared here (no GPU): under bf16 ZeRO-2 keeps Muon's momentum in the gradients' bf16
    (stage_1_and_2.py _muon_momentum_buffer), where torch's path keeps it in float32.
    """
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    t, m = config.train, config.train.muon
    lr = m.lr if m.lr is not None else t.lr
    matrices, rest = muon_split(model)
    by_shape: dict[tuple[int, ...], list[torch.nn.Parameter]] = {}
    for p in matrices:
        by_shape.setdefault(tuple(p.shape), []).append(p)
    groups: list[dict] = []
    for (rows, cols), params in by_shape.items():
        ratio = deepspeed_muon_lr_ratio(m.adjust_lr_fn, rows, cols)
        groups.append(
            {
                "params": params,
                "use_muon": True,
                "lr": lr * ratio,
                "weight_decay": m.weight_decay / ratio,
                "momentum": m.momentum,
                "ns_method": "standard",
            }
        )
    if rest:
        groups.append(
            {
                "params": rest,
                "use_muon": False,
                "lr": t.lr,
                "betas": tuple(t.betas),
                "eps": t.adam_eps,
                "weight_decay": m.adamw_weight_decay,
            }
        )
    for group in groups:
        for p in group["params"]:
            p.use_muon = group["use_muon"]  # what ZeRO's partitioning reads
    return MuonWithAuxAdam(
        groups, adam_optimizer=torch.optim.AdamW, adam_optimizer_kwargs={"fused": fused}
    )


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
