"""tools/bench/first_step_vs_speculators.py: with ours' settings made speculators' (AGREE),
the first step of each side on the same batch and weights agrees (loss, gradients, the
optimizers' update); with one of those settings left at ours' default (the negative
control) it does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from support.scripts import load_script
from support.train import make_inputs, write_target_model

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "bench" / "first_step_vs_speculators.py"


@pytest.fixture(scope="module")
def tool():
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def recipe_and_run(tmp_path_factory) -> tuple[Path, Path]:
    """A run of a small Llama target (its weights, for speculators' verifier loading) whose
    dataset's frozen head is the target's own, as eagle3-extract writes it, and a recipe
    with the tiny recipe's optimizer."""
    root = tmp_path_factory.mktemp("first-step")
    inputs = make_inputs(root / "run", num_samples=48)
    write_target_model(inputs.target)
    weights = load_file(str(inputs.target / "model.safetensors"))
    head = {k: weights[f"model.{k}"] for k in ("embed_tokens.weight", "norm.weight")}
    save_file(
        {**head, "lm_head.weight": weights["lm_head.weight"]},
        str(inputs.hidden_states / "target_head.safetensors"),
    )
    recipe = root / "recipe"
    recipe.mkdir()
    (recipe / "target").symlink_to(inputs.target)
    tiny = yaml.safe_load((ROOT / "recipes" / "tiny" / "train.yaml").read_text())
    config = {
        "target": {"path": str(inputs.target)},
        "draft": {"num_layers": 1},
        "data": {**tiny["data"], "hidden_states": "", "vocab_map": ""},
        "train": {**tiny["train"], "trackers": []},
        "export": tiny["export"],
    }
    (recipe / "train.yaml").write_text(yaml.safe_dump(config))
    return recipe, inputs.root


def test_the_first_steps_agree_where_the_settings_do(
    tool, recipe_and_run, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe, run = recipe_and_run
    assert tool.main(["--recipe", str(recipe), "--run", str(run), "--steps", "150"]) == 0
    out = capsys.readouterr().out
    assert "the first steps agree" in out
    # the schedules no setting aligns: at >= 100 steps speculators warms up from lr 0
    assert "step    0: ours 0.0333  speculators 0.0000" in out


def test_a_setting_left_at_ours_default_differs(
    tool, recipe_and_run, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe, run = recipe_and_run
    agree = [s for s in tool.AGREE if not s.startswith("train.ttt_step_loss_decay")]
    assert len(agree) == len(tool.AGREE) - 1
    monkeypatch.setattr(tool, "AGREE", agree)  # ours' step weights 0.8^k stay
    assert tool.main(["--recipe", str(recipe), "--run", str(run), "--steps", "40"]) == 1
    assert "the first steps DIFFER" in capsys.readouterr().out
