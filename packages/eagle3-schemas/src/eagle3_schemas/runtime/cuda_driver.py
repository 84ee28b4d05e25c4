"""Does this host's NVIDIA driver support the CUDA release torch (and vLLM) were built for?

torch 2.14 (+cu130) and vLLM 0.33 need a driver that supports CUDA 13 (R580 or newer). With an
older driver torch quietly reports ``cuda.is_available() == False`` and a GPU job runs on the
CPU or dies deep inside vLLM, so every stage's preflight and ``eagle3-extract plan`` ask here
first. The driver's version comes from ``cuDriverGetVersion`` in libcuda (no torch needed);
the comparison is a plain function of both versions, so it is tested on any machine.

CUDA's minor-version compatibility: a driver of CUDA major M runs any M.x runtime (features of
a newer minor may be missing, hence a warning); an older major does not run at all.
"""

from __future__ import annotations

import ctypes
import importlib.util
import re
import sys
from pathlib import Path

# The first Linux driver branch of each CUDA major (what to install when it is too old).
DRIVER_BRANCH = {12: "R525", 13: "R580"}

Version = tuple[int, int]


def parse_cuda_version(value: str | int) -> Version:
    """``"13.0"`` → (13, 0); cuDriverGetVersion's ``12040`` → (12, 4)."""
    if isinstance(value, int):
        return value // 1000, (value % 1000) // 10
    match = re.fullmatch(r"(\d+)\.(\d+)(?:\.\d+)?", value.strip())
    if not match:
        raise ValueError(f"CUDA version {value!r}: expected MAJOR.MINOR, e.g. 13.0")
    return int(match.group(1)), int(match.group(2))


def driver_cuda_version() -> Version | None:
    """The newest CUDA release the installed NVIDIA driver supports; None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
        return None
    return parse_cuda_version(version.value)


def torch_cuda_version() -> str | None:
    """The CUDA release the installed torch was built for (``torch.version.cuda``), read
    without importing torch when it is not imported yet (``eagle3-extract plan`` stays light)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(getattr(torch, "version", None), "cuda", None)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_py = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    if not version_py.is_file():
        return None
    match = re.search(r"^cuda\b[^=]*=\s*['\"]([\d.]+)['\"]", version_py.read_text(), re.M)
    return match.group(1) if match else None


def driver_verdict(
    driver: Version | None, runtime: str | None, who: str = "torch"
) -> tuple[str, str] | None:
    """(level, message) comparing the driver's CUDA with the ``runtime`` ``who`` was built for;
    None where there is nothing to compare (a CPU build of torch, or no NVIDIA driver)."""
    if runtime is None or driver is None:
        return None
    need = parse_cuda_version(runtime)
    have = f"{driver[0]}.{driver[1]}"
    if driver[0] < need[0]:
        branch = DRIVER_BRANCH.get(need[0])
        return (
            "error",
            f"the NVIDIA driver supports CUDA {have} but {who} is built for CUDA {runtime}: "
            f"a CUDA {need[0]} runtime needs a driver that supports CUDA {need[0]}"
            + (f" ({branch} or newer)" if branch else "")
            + "; upgrade the driver, or install a build of torch/vLLM for CUDA "
            f"{driver[0]} (torch.cuda would report no GPU and the job would run on the CPU)",
        )
    if driver < need:
        return (
            "warning",
            f"the NVIDIA driver supports CUDA {have}, {who} is built for CUDA {runtime}: runs "
            "under CUDA minor-version compatibility, but kernels that need the newer minor "
            "release may fail; a newer driver is the safe choice",
        )
    return ("ok", f"the NVIDIA driver supports CUDA {have}; {who} is built for CUDA {runtime}")


def check_this_host(who: str = "torch") -> tuple[str, str] | None:
    """``driver_verdict`` for this machine's driver and installed torch."""
    return driver_verdict(driver_cuda_version(), torch_cuda_version(), who)
