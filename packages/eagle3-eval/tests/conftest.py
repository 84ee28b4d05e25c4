from __future__ import annotations

from pathlib import Path

import pytest

from support import fixtures, tiny_draft
from support.vllm_env import vllm_python_or_skip

REPO = Path(__file__).resolve().parents[3]
TINY_TARGET = REPO / "recipes" / "tiny" / "target"


@pytest.fixture
def fixture_draft(tmp_path: Path) -> Path:
    """The schema library's small draft: H=8, aux ids [1,2,3], V_target 32, V_draft 12."""
    return fixtures.build("draft_checkpoint", tmp_path)


@pytest.fixture
def fixture_hidden_states(tmp_path: Path) -> Path:
    return fixtures.build("hidden_states", tmp_path)


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    assert (TINY_TARGET / "model.safetensors").is_file(), (
        f"{TINY_TARGET} is missing; build it with tools/targets/build_tiny_target.py"
    )
    return TINY_TARGET


@pytest.fixture(scope="session")
def tiny_assets(tiny_target: Path) -> Path:
    """Trained + untrained drafts, held-out hidden states and corpus for the tiny target.

    Built once by tests/support/tiny_draft.py (about 5 minutes on 2 cores) into a cache folder
    keyed by the content of what builds them (its ``assets_key``: target weights and tokenizer,
    stdlib, the builder's and the eval/schemas sources it uses, settings, torch and transformers
    releases); later sessions reuse it until one of those changes.
    """
    out = Path(tiny_draft.run_fresh("--print-dir", capture=True).strip())
    if not out.is_dir():
        tiny_draft.run_fresh()
    return out


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return vllm_python_or_skip()
