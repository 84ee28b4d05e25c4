"""The workspace installs stage by stage: a stage pulls eagle3-schemas, never vLLM or another stage."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # each test runs uv or a fresh interpreter

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["eagle3-data", "eagle3-extract", "eagle3-train", "eagle3-eval"]


def _locked_requirements(package: str, *extra: str) -> set[str]:
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("uv is not on PATH; the workspace is managed with uv (pip install uv)")
    done = subprocess.run(
        [
            uv,
            "export",
            "--frozen",
            "--package",
            package,
            "--no-dev",
            "--no-hashes",
            "--no-header",
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    names = set()
    for line in done.stdout.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "--")):
            names.add(
                re.split(r"[=<>;@ \[]", line.removeprefix("-e ./packages/"), maxsplit=1)[0].lower()
            )
    return names


@pytest.mark.parametrize("stage", STAGES)
def test_a_stage_installs_without_vllm_or_other_stages(stage: str) -> None:
    names = _locked_requirements(stage)
    assert "eagle3-schemas" in names
    assert "vllm" not in names
    assert not (set(STAGES) - {stage}) & names, (
        f"{stage} pulls another stage: {sorted(set(STAGES) & names)}"
    )


def test_the_contract_library_needs_no_torch() -> None:
    assert "torch" not in _locked_requirements("eagle3-schemas")


@pytest.mark.parametrize("stage", ["eagle3-extract", "eagle3-eval"])
def test_vllm_is_an_extra(stage: str) -> None:
    assert "vllm" in _locked_requirements(stage, "--extra", "vllm")


def test_a_plain_uv_run_installs_every_stage_and_what_the_recipes_use() -> None:
    """`uv run pytest` / the tiny recipe on a fresh clone: the root project pulls every stage
    with the CPU-usable extras the recipes ask for (TensorBoard tracker, DeepSpeed configs,
    eval figures), and never the CUDA vLLM."""
    uv = shutil.which("uv")
    assert uv is not None
    done = subprocess.run(
        [uv, "export", "--frozen", "--no-dev", "--no-hashes", "--no-header"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    names = {
        re.split(r"[=<>;@ \[]", line.strip().removeprefix("-e ./packages/"), maxsplit=1)[0].lower()
        for line in done.stdout.splitlines()
        if line.strip() and not line.startswith(("#", "--", " "))
    }
    assert {*STAGES, "eagle3-schemas", "tensorboard", "deepspeed", "matplotlib"} <= names
    assert "vllm" not in names
