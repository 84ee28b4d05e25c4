"""The recipe `eagle3-recipe new` writes for each public target passes every stage's preflight on
CPU, on a stand-in of that target: all eleven (tests/fixtures/public_targets), the MLA + MoE ones
(DeepSeek-V3, Kimi-K2.5: remote code, ``--trust-remote-code`` in every stage's flags) included.

`new` reads the published config.json (no weights) and writes flags.sh and train.yaml; the stages
then run with exactly those arrays and that config on a stand-in built from the same facts
(tests/support/public_standins.py), as tests/test_recipes.py runs the committed recipes
(tests/support/recipe_stages.py): ingest → tokenize + vocab → `eagle3-extract preflight` and
`run` (transformers backend) → `eagle3-train --preflight` (a forward and backward of the draft).

Each stand-in is built once per module and shared by the tests that use it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from eagle3_recipe.cli import main as recipe_main
from eagle3_recipe.plan import Request, make_plan

from support import public_standins, public_targets, recipe_stages

# The stages' CLIs run in this process, but tokenize and the stand-ins' builders start processes.
pytestmark = pytest.mark.process

STAGES = ("ingest", "tokenize", "vocab", "extract preflight", "extract run", "train preflight")
# The node each target is planned on: 8 H100s, or 8 H200s for the MLA targets, whose weights
# (DeepSeek-V3 fp8 689 GB, Kimi-K2.5 int4 594 GB) do not fit one node of H100s.
H200_TARGETS = {"DeepSeek-V3", "Kimi-K2.5"}


def gpu_for(name: str) -> str:
    return "h200" if name in H200_TARGETS else "h100"


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The stand-in of a public target, built on first use and shared by this module's tests."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("standins")

    def get(name: str) -> Path:
        if name not in built:
            built[name] = public_standins.build(name, root / name)
        return built[name]

    return get


def knobs(name: str, work: Path) -> dict[str, str]:
    """flags.sh's device-count knob at its smallest: one GPU, or one engine's TP where the
    weights need several (Llama-3.1-70B on H100s: TP 4; flags.sh refuses fewer)."""
    plan = make_plan(Request(public_targets.model_dir(name, work / "facts"), gpu_for(name)))
    tp = plan.value("extraction").tp
    return {**recipe_stages.CPU_KNOBS, "NGPU": str(tp if tp < plan.gpus else 1)}


def new_recipe(name: str, work: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> Path:
    """`eagle3-recipe new` on the public config, in a repository holding what `new` looks for;
    the recipe folder."""
    repo = work / "repo"
    (repo / "recipes" / "llama-3.1-8b").mkdir(parents=True)
    (repo / "recipes" / "llama-3.1-8b" / "pipeline.sh").write_text("#!/usr/bin/env bash\n")
    facts = public_targets.model_dir(name, work / "facts")
    monkeypatch.chdir(repo)
    argv = ["new", "--target", str(facts), "--gpu", gpu_for(name), "--name", "mine", *extra]
    assert recipe_main(argv) == 0
    return repo / "recipes" / "mine"


@pytest.mark.parametrize("name", public_targets.PLANNED)
def test_a_generated_recipe_passes_every_stages_preflight(
    name: str, standin: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = new_recipe(name, tmp_path, monkeypatch)
    (tmp_path / "work").mkdir()
    run = recipe_stages.run_stages(
        name, tmp_path / "work", folder, standin(name), knobs(name, tmp_path)
    )
    check_passed(run)


def check_passed(run: recipe_stages.StagesRun) -> None:
    """Every stage exited 0: each conversation tokenized, no preflight finding an error, the
    train preflight's forward and backward run."""
    for stage in STAGES:
        recipe_stages.passed(run, stage)
    written = run.outcomes["tokenize"].summary()["written"]
    assert written == len(recipe_stages.CONVERSATIONS), run.outcomes["tokenize"].stdout
    assert "[error" not in run.outcomes["extract preflight"].stdout
    report = run.outcomes["train preflight"].log
    assert "0 error(s)" in report and "dry_run: forward+backward" in report, report[-3000:]
