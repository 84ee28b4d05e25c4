"""train.max_grad_norm with train.optimizer: muon under DeepSpeed ZeRO-2: the gradient clipped
before Newton–Schulz, as the single-process path clips it (torch's clip_grad_norm_, then
torch.optim.Muon), where DeepSpeed's own gradient_clipping would clip the orthogonalised update.

Why DeepSpeed cannot do it itself. ZeRO-2 orthogonalises each Muon matrix at the end of the
last backward of a step, inside ``get_flat_partition``, group by group as each group's reduced
gradient arrives (zero/stage_1_and_2.py ``independent_gradient_partition_epilogue``); its
norm and clip come later, in ``step()``, over what the partitions then hold: the orthogonalised
updates. The global norm of the gradients is only known once every group is reduced, after the
first group was already orthogonalised.

What this does, on one ZeRO-2 optimizer (``install``):
- while that optimizer's ``get_flat_partition`` runs (and only then: the module attribute is
  put back before it returns), DeepSpeed's ``muon_update`` is swapped for one that records its
  call and returns the reduced gradient itself, so the partition holds views of the raw
  gradient instead of the update;
- before its ``step()``: the squared norm of this rank's partition of every group (each
  element of the model is in exactly one rank's partition), one all-reduce over the data-parallel
  group, the coefficient torch's clip_grad_norm_ uses (max_norm / (norm + 1e-6), at most 1;
  1 where the norm is not finite, so DeepSpeed's overflow handling sees the gradients as they
  were), every gradient scaled by it in place, then the recorded ``muon_update`` calls run on
  the clipped gradients and write the update over the gradient, into the views the partition
  holds. No value goes to the host (CUDA: no sync);
- DeepSpeed's own clip is off (gradient_clipping 0, components/accelerator.py; checked at every
  step, as a resumed ZeRO checkpoint restores its clip_grad);
- the gradient norm DeepSpeed reports for the step (``_global_grad_norm``, what
  Accelerator.clip_grad_norm_ returns) is the clipped-before norm, as the single process reports.

What it relies on in DeepSpeed is listed by ``contract_problems`` (preflight's interface check
calls it, and ``install`` refuses a DeepSpeed where it finds a problem); that the whole equals
torch's Muon with the clip is tests/test_muon_zero.py.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# What get_flat_partition's source must do for the swap to reach it: import muon_update from
# its module when it runs (not a name bound at import time) and call it
MUON_MODULE = "deepspeed.runtime.zero.muon.original_muon"
CALL_TIME_IMPORT = f"from {MUON_MODULE} import muon_update"
FLAT_PARTITION = ("get_flat_partition", "_get_flat_partition_unpadded")
# attributes of DeepSpeedZeroOptimizer this module reads or sets
ZERO_ATTRIBUTES = (
    "step",
    "averaged_gradients",
    "dp_process_group",
    "has_moe_layers",
    "partition_gradients",
    "clip_grad",
    "loss_scale",
    "overflow",
    "_global_grad_norm",
    "optimizer",
)


class ZeroClipError(RuntimeError):
    pass


def contract_problems() -> list[str]:
    """What of the DeepSpeed installed here differs from what ``install`` relies on (one
    message each, naming the DeepSpeed version and the missing piece); [] when nothing."""
    try:
        import deepspeed
        from deepspeed.runtime.zero import stage_1_and_2
        from deepspeed.runtime.zero.muon import original_muon
    except ImportError as e:
        return [f"deepspeed's ZeRO-2 Muon does not import ({e})"]
    ds = f"deepspeed {deepspeed.__version__}"
    out = []
    update = getattr(original_muon, "muon_update", None)
    if not callable(update):
        out.append(f"{ds}: {MUON_MODULE}.muon_update is missing")
    else:
        params = list(inspect.signature(update).parameters)
        if params[:2] != ["grad", "momentum"]:
            out.append(f"{ds}: {MUON_MODULE}.muon_update(grad, momentum, ...) now takes {params}")
    if hasattr(stage_1_and_2, "muon_update"):
        out.append(f"{ds}: stage_1_and_2 binds muon_update at import time, out of the swap's reach")
    zero = stage_1_and_2.DeepSpeedZeroOptimizer
    for name in FLAT_PARTITION:
        fn = getattr(zero, name, None)
        source = inspect.getsource(fn) if callable(fn) else ""
        if CALL_TIME_IMPORT not in source or "muon_update(" not in source:
            out.append(
                f"{ds}: DeepSpeedZeroOptimizer.{name} no longer runs `{CALL_TIME_IMPORT}` and "
                "calls it (the clip before Newton–Schulz swaps that module attribute)"
            )
    members = set(dir(zero))
    init = inspect.getsource(zero.__init__)
    for name in ZERO_ATTRIBUTES:
        if name not in members and f"self.{name} =" not in init:
            out.append(f"{ds}: DeepSpeedZeroOptimizer has no {name}")
    return out


def install(zero: Any, max_norm: float) -> ZeroClip:
    """Clip ``zero``'s (a DeepSpeedZeroOptimizer at stage 2 over a MuonWithAuxAdam) gradients
    to ``max_norm`` before Newton–Schulz, on this one instance (its methods, not its class)."""
    problems = contract_problems()
    if problems:
        raise ZeroClipError(
            "train.max_grad_norm with train.optimizer: muon under ZeRO-2 relies on DeepSpeed "
            "internals that changed: " + "; ".join(problems)
        )
    if not getattr(zero, "partition_gradients", False) or zero.has_moe_layers:
        raise ZeroClipError(
            f"the clip before Newton–Schulz covers ZeRO stage 2 without MoE; {type(zero).__name__} "
            f"has partition_gradients={getattr(zero, 'partition_gradients', None)}, "
            f"has_moe_layers={zero.has_moe_layers}"
        )
    return ZeroClip(zero, max_norm)


class ZeroClip:
    def __init__(self, zero: Any, max_norm: float) -> None:
        from deepspeed.runtime.zero.muon import original_muon

        self.zero, self.max_norm = zero, float(max_norm)
        self.module = original_muon
        self.real_update = original_muon.muon_update
        # group index -> the muon_update calls its last get_flat_partition made
        self.recorded: dict[int, list[tuple[tuple, dict]]] = {}
        self.real_flat_partition = zero.get_flat_partition
        self.real_step = zero.step
        zero.get_flat_partition = self.get_flat_partition
        zero.step = self.step

    def get_flat_partition(self, *args, **kwargs):
        """DeepSpeed's, with muon_update deferred to step() (recorded, the gradient returned)."""
        group = kwargs["param_group_idx"] if "param_group_idx" in kwargs else args[5]
        calls: list[tuple[tuple, dict]] = []

        def deferred(*a, **k):
            if not a[0].is_contiguous():  # the partition would hold a copy, not a view
                raise ZeroClipError(f"a Muon gradient of shape {tuple(a[0].shape)} is strided")
            calls.append((a, k))
            return a[0]  # the gradient: the partition holds views of it until step()

        if self.module.muon_update is not self.real_update:
            raise ZeroClipError(f"{MUON_MODULE}.muon_update was replaced by someone else")
        self.module.muon_update = deferred
        try:
            out = self.real_flat_partition(*args, **kwargs)
        finally:
            self.module.muon_update = self.real_update
        self.recorded[group] = calls  # the last call for a group wins, as in DeepSpeed
        return out

    @torch.no_grad()
    def step(self, *args, **kwargs):
        """The clip and Muon's deferred updates, then DeepSpeed's step."""
        zero = self.zero
        if zero.clip_grad != 0:
            raise ZeroClipError(
                f"DeepSpeed's gradient_clipping is {zero.clip_grad} on a run that clips before "
                "Newton–Schulz (train.max_grad_norm): both would clip"
            )
        try:
            norm = self.clip()
            out = self.real_step(*args, **kwargs)
            if not zero.overflow:
                zero._global_grad_norm = norm  # the gradients' norm, as the single process's
            return out
        finally:
            self.recorded = {}

    def clip(self) -> torch.Tensor:
        """Every rank's partitions clipped by the global norm, then Muon's deferred updates
        run on them; the norm before the clip (loss scale removed)."""
        zero = self.zero
        muon_groups = {
            i
            for i, g in enumerate(zero.optimizer.param_groups)
            if g.get("use_muon") and zero.averaged_gradients.get(i) is not None
        }
        missed = sorted(i for i in muon_groups if not self.recorded.get(i))
        if missed:
            raise ZeroClipError(
                f"ZeRO-2 Muon groups {missed} were orthogonalised without passing the swapped "
                "muon_update: the clip would come after Newton–Schulz"
            )
        parts = []
        for grads in zero.averaged_gradients.values():
            if grads is None:
                continue
            parts += [grads] if isinstance(grads, torch.Tensor) else list(grads)
        import deepspeed.comm as dist

        squares = [torch.linalg.vector_norm(p, dtype=torch.float32).square() for p in parts]
        total = (
            torch.stack(squares).sum()
            if squares
            else torch.zeros((), dtype=torch.float32, device=zero.device)
        )

        dist.all_reduce(total, group=zero.dp_process_group)
        norm = total.sqrt() / zero.loss_scale  # a float or a tensor: no host sync either way
        coefficient = torch.clamp(self.max_norm / (norm + 1e-6), max=1.0)
        coefficient = torch.where(torch.isfinite(norm), coefficient, torch.ones_like(norm))
        for i, grads in zero.averaged_gradients.items():
            if grads is None or i in muon_groups:
                continue
            for g in [grads] if isinstance(grads, torch.Tensor) else grads:
                g.mul_(coefficient.to(g.dtype))
        for i in muon_groups:
            for a, k in self.recorded[i]:
                grad = a[0]
                grad.mul_(coefficient.to(grad.dtype))  # the partition's views see it too
                grad.copy_(self.real_update(*a, **k))
        return norm
