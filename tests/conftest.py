from __future__ import annotations

from pathlib import Path

import pytest

from support.vllm_env import vllm_python_or_skip


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return vllm_python_or_skip()


@pytest.fixture(scope="session")
def kimi_standin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Kimi-K2.5-shaped stand-in (tests/support/kimi_standin.py), built once per session
    (its BPE is learned at build time: 20-40 s on 2 cores). Tests only read it; one that changes
    it works on a copy."""
    from support import kimi_standin

    return kimi_standin.build_standin(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5-standin")
