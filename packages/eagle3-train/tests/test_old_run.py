"""A run written before eagle3_train became subpackages (main at 49c985f) still resumes and its
draft still starts a new run.

``fixtures/run-49c985f`` was written by that commit's trainer: synthetic inputs, a run of 6
steps (checkpoints every 3, kept here: step 3), its published draft, and the losses it logged.
Resuming the step-3 checkpoint with today's code must log the same losses for steps 4-6: the
checkpoint holds no module path that the moves changed (Accelerate's state is tensors and RNG
states; trainer_state.json is plain JSON), and the training step is unchanged.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from eagle3_schemas.contract.validate import validate

FIXTURE = Path(__file__).parent / "fixtures" / "run-49c985f"
WRITTEN_AT = "/tmp/oldckpt/fixture"  # where 49c985f's run lived; run.yaml names its paths


@pytest.fixture
def old_run(tmp_path: Path) -> Path:
    root = tmp_path / "old"
    shutil.copytree(FIXTURE, root)
    return root


def _config(root: Path, output_dir: Path, **overrides) -> Path:
    """The old run's own run.yaml, its paths moved to where the copy lies."""
    text = (root / "run" / "run.yaml").read_text(encoding="utf-8").replace(WRITTEN_AT, str(root))
    config = yaml.safe_load(text)
    config["output_dir"] = str(output_dir)
    for section, values in overrides.items():
        config[section].update(values)
    path = output_dir.parent / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def _train_losses(metrics: Path) -> dict[int, float]:
    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {e["step"]: e["loss"] for e in events if e.get("event") == "train"}


def test_the_old_checkpoint_resumes_and_logs_the_old_runs_losses(old_run, in_process, caplog):
    expected = json.loads((old_run / "expected_losses.json").read_text())["losses"]
    config = _config(old_run, old_run / "run")  # train.resume: auto -> checkpoints/step-3
    with caplog.at_level(logging.INFO, logger="eagle3_train"):
        assert in_process(["--config", str(config)]) == 0  # preflight included
    assert "resumed from" in caplog.text
    got = _train_losses(old_run / "run" / "metrics.jsonl")
    assert sorted(got) == [4, 5, 6], got
    for step in (4, 5, 6):
        # float32 on another CPU's kernels (AVX2 vs AVX512 reductions), three steps on
        assert got[step] == pytest.approx(expected[str(step)], rel=1e-5), step


def test_the_old_draft_validates_and_starts_a_new_run(old_run, tmp_path, in_process, caplog):
    draft = old_run / "run" / "draft"
    assert validate(draft) == []
    config = _config(
        old_run,
        tmp_path / "continued",
        draft={"init_from": str(draft)},
        train={"max_steps": 2, "save_every": 0},
    )
    with caplog.at_level(logging.INFO, logger="eagle3_train"):
        assert in_process(["--config", str(config)]) == 0
    assert "24 rows carried over, 0 from the target's rows" in caplog.text
    assert validate(tmp_path / "continued" / "draft") == []
