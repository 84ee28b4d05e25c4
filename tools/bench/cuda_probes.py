"""bench_train.py's probes of one training step of ours: the op that makes the host wait
(under ``torch.cuda.set_sync_debug_mode("error")``), the host→device copies from pageable
memory, the kernels that took most of the step (tools/gpu/gpu_check.py's llama row), and (on
either device) the step's time by part.
"""

from __future__ import annotations

from pathlib import Path


def raised_at(e: BaseException, frames: int = 5) -> str:
    """Where an error was raised: the traceback's last frames (the op and the line of ours or
    speculators' that called it) and the message's first line — c10's text alone says that
    a step synchronised, not which op did."""
    import traceback

    tail = traceback.extract_tb(e.__traceback__)[-frames:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.line}" for f in reversed(tail))
    return f"{where} :: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def pageable_copies(step) -> list[str]:
    """The host→device copies of one step whose source is pageable memory, each with the line
    that made it: a non-blocking copy from pageable memory is staged through a buffer the host
    waits for, which the sync debug mode does not see. (Compiled code runs eagerly under the
    watch: this step checks the copies, it is not timed.)"""
    import traceback

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
    found: list[str] = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in copies:
                src = args[1] if func is torch.ops.aten.copy_.default else args[0]
                if src.device.type == "cpu" and out.device.type == "cuda" and not src.is_pinned():
                    stack = traceback.extract_stack()[:-1]  # this frame left out
                    site = next(f for f in reversed(stack) if "/torch/" not in f.filename)
                    found.append(
                        f"{tuple(src.shape)} {src.dtype} at {Path(site.filename).name}:"
                        f"{site.lineno} {site.line}"
                    )
            return out

    with Watch():
        step()
    torch.cuda.synchronize()
    return found


def top_kernels(step, count: int = 12) -> list[list]:
    """[name, CUDA ms, calls] of the kernels that took most of one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        import torch

        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    return [[e.key[:90], round(e.device_time_total / 1e3, 3), e.count] for e in rows[:count]]


# kernel (CUDA) or op (CPU) names of each part, by substring, the first match counting
KERNEL_PARTS = {
    "attention": ("flash", "fmha", "attention", "sdpa"),
    "loss": ("log_softmax", "logsoftmax", "_softmax", "kl_div"),
    "gemm": ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm",
             "aten::bmm", "aten::baddbmm"),
    "copies": ("memcpy", "memset", "aten::copy_", "aten::_to_copy"),
}  # fmt: skip
PHASES = ("forward", "backward", "optimizer")  # the step's record_function ranges: "bench.<phase>"


def part_times(step, device: str) -> dict[str, float]:
    """One profiled step, in ms: its phases (``bench.forward``, ``bench.backward`` and
    ``bench.optimizer`` ranges, which the step opens) and its kernels by part (KERNEL_PARTS,
    the rest "other"): on CUDA the kernels' device time, on CPU the ops' own time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    times = {f"phase_{phase}": 0.0 for phase in PHASES}
    times.update({part: 0.0 for part in (*KERNEL_PARTS, "other")})
    for event in prof.key_averages():
        name = event.key
        if name.startswith("bench."):
            phase = name.removeprefix("bench.")
            if phase in PHASES:
                total = event.device_time_total if cuda else event.cpu_time_total
                times[f"phase_{phase}"] += total / 1e3
            continue
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if not own:
            continue
        lowered = name.lower()
        part = next(
            (p for p, keys in KERNEL_PARTS.items() if any(k in lowered for k in keys)), "other"
        )
        times[part] += own / 1e3
    return {k: round(v, 3) for k, v in times.items()}
