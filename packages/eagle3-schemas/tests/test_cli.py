"""`eagle3-schemas validate` exits 0 on clean artifacts and 1 listing every violation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_schemas.cli import main

from support.edits import rewrite_tensors
from support.fixtures import build


def test_validate_clean_and_corrupt(tmp_path: Path, capsys) -> None:
    good = build("hidden_states", tmp_path / "a")
    bad = build("vocab_map", tmp_path / "b")
    rewrite_tensors(bad, lambda t: t.pop("t2d"))
    assert main(["validate", str(good)]) == 0
    assert main(["validate", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"ok      {good}" in out
    assert f"INVALID {bad}: 1 violation(s)" in out
    assert f"{bad}: tensor t2d: missing (expected BOOL ['V_target'])" in out


@pytest.mark.process
def test_console_script_runs_as_a_module(tmp_path: Path) -> None:
    path = build("draft_checkpoint", tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_schemas.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "eagle3_schemas.cli", "meta-check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "0 problem(s)" in done.stdout


def test_shallow_validation_skips_the_full_data_scan(tmp_path: Path) -> None:
    import numpy as np

    from eagle3_schemas import validate

    root = build("hidden_states", tmp_path)
    shard = root / "shards" / "shard-00000.safetensors"
    rewrite_tensors(shard, lambda t: t["last_hidden_state"].__setitem__((0, 0), np.float32(np.nan)))
    deep = {v.location.split(",")[-1].strip() for v in validate(root)}
    assert {"column checksum", "tensor last_hidden_state"} <= deep
    assert validate(root, deep=False) == []
    assert main(["validate", "--shallow", str(root)]) == 0
