"""The schema files themselves: valid against the meta-schema, frozen once released."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3_schemas.contract.meta_check import freeze, meta_check
from eagle3_schemas.contract.registry import SCHEMA_DIR, load_schema


@pytest.fixture
def schema_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "schemas"
    shutil.copytree(SCHEMA_DIR, copy)
    return copy


def _edit(path: Path, change) -> None:
    obj = json.loads(path.read_text())
    change(obj)
    path.write_text(json.dumps(obj, indent=2))


def test_shipped_schema_files_pass() -> None:
    assert meta_check() == []


def test_every_schema_states_conventions_and_lineage() -> None:
    hidden = load_schema("hidden_states")
    assert "vLLM's convention" in hidden["conventions"]["layer_ids"]
    assert "BEFORE the final norm" in hidden["conventions"]["layer_ids"]
    assert "target_id = i + d2t[i]" in load_schema("vocab_map")["conventions"]["d2t"]
    assert "loss_mask[t+1+k]" in load_schema("tokenized")["conventions"]["shift"]


def test_editing_a_released_version_fails(schema_copy: Path) -> None:
    _edit(
        schema_copy / "tokenized/v1.json",
        lambda s: s["files"]["tokenized"]["columns"]["input_ids"].update(type="list<uint8>"),
    )
    problems = meta_check(schema_copy)
    assert problems == [
        p for p in problems if p.startswith("tokenized/v1.json: released schema was edited")
    ]
    assert len(problems) == 1


def test_deleting_a_released_version_fails(schema_copy: Path) -> None:
    (schema_copy / "eval_report/v1.json").unlink()
    assert "eval_report/v1.json: frozen schema file was deleted" in meta_check(schema_copy)


def test_a_new_version_must_be_frozen_to_release(schema_copy: Path) -> None:
    v2 = json.loads((schema_copy / "tokenized/v1.json").read_text())
    v2["version"] = 2
    (schema_copy / "tokenized/v2.json").write_text(json.dumps(v2))
    assert meta_check(schema_copy) == [
        "tokenized/v2.json: not frozen; release it with `eagle3-schemas freeze`"
    ]
    assert freeze(schema_copy) == ["tokenized/v2.json"]
    assert meta_check(schema_copy) == []


def test_structural_mistakes_in_a_schema_file_are_found(schema_copy: Path) -> None:
    def break_it(s: dict) -> None:
        s["files"]["weights"]["tensors"]["fc.weight"]["shape"] = ["H", "n_aux_X"]
        s["files"]["weights"]["tensors"]["norm.weight"]["dtype"] = ["F17"]
        s["checks"]["sparkles"] = "a check nobody implemented"
        s["version"] = 3

    _edit(schema_copy / "draft_checkpoint/v1.json", break_it)
    problems = "\n".join(meta_check(schema_copy))
    assert "shape symbol 'n_aux_X' is not declared" in problems
    assert "'F17' is not one of" in problems
    assert "check 'sparkles' has no implementation" in problems
    assert "do not match the path" in problems
