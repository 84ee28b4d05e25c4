from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = os.environ.get("EAGLE3_VLLM_PYTHON")
    if not python:
        pytest.skip("EAGLE3_VLLM_PYTHON is not set (create it with tools/ci/setup_vllm_cpu.sh)")
    return python
