"""Fuzzed validation: an artifact of any kind, damaged anywhere, yields a list of violations.

Each example takes a valid fixture artifact (``support.fixtures``) and damages it once: a file's
bytes cut short, flipped, overwritten or extended; a file removed or turned into a directory;
a JSON file or the header edited at a random place to any JSON value. ``validate`` must return
a list of ``Violation`` (empty when the damage broke no rule), deep or not, and never raise.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from eagle3_schemas import validate
from eagle3_schemas.contract.artifact import Violation

from support.edits import artifact_files, rewrite_header
from support.fixtures import BUILDERS, build
from support.fuzz import FUZZ, json_of, outcome, places

READER = "validators"
KINDS = list(BUILDERS)  # every kind of artifact
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
    | st.sampled_from(["conversations", "hidden_states", "1", "v2", "../x", "/abs", ""])
)
ANY_JSON = json_of(SCALARS, keys=st.text(max_size=6), max_leaves=6)


@pytest.fixture(scope="module")
def valid() -> Iterator[dict[str, Path]]:
    """One valid artifact of each kind, copied for every example."""
    with tempfile.TemporaryDirectory() as tmp:
        yield {kind: build(kind, Path(tmp) / kind) for kind in KINDS}


def _edit_json(data: st.DataObject, value: Any) -> Any:
    """``value`` with one node replaced by any JSON value, or removed."""
    path = data.draw(st.sampled_from(places(value)))
    if not path:
        return data.draw(ANY_JSON)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(ANY_JSON)
    return value


def _damage(data: st.DataObject, root: Path) -> str:
    files = artifact_files(root)
    file = data.draw(st.sampled_from(files))
    ops = ["cut", "flip", "overwrite", "append", "remove", "directory", "header"]
    if file.suffix == ".json":
        ops.append("json")
    op = data.draw(st.sampled_from(ops))
    raw = file.read_bytes()
    at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
    if op == "cut":
        file.write_bytes(raw[:at])
    elif op == "flip" and raw:
        bit = data.draw(st.integers(0, 7))
        file.write_bytes(raw[:at] + bytes([raw[at] ^ (1 << bit)]) + raw[at + 1 :])
    elif op == "overwrite":
        junk = data.draw(st.binary(min_size=1, max_size=16))
        file.write_bytes(raw[:at] + junk + raw[at + len(junk) :])
    elif op == "append":
        file.write_bytes(raw + data.draw(st.binary(min_size=1, max_size=16)))
    elif op == "remove":
        file.unlink()
    elif op == "directory":
        file.unlink()
        file.mkdir()
    elif op == "header":

        def edit(header: dict[str, Any]) -> None:
            new = _edit_json(data, copy.deepcopy(header))
            header.clear()
            header.update(new if isinstance(new, dict) else {})

        rewrite_header(root, edit)
    elif op == "json":
        text = json.dumps(_edit_json(data, json.loads(raw)), allow_nan=True)
        file.write_text(text, encoding="utf-8")
    return f"{op} {file.relative_to(root.parent)}"


@FUZZ
@given(kind=st.sampled_from(KINDS), deep=st.booleans(), data=st.data())
def test_damaged_artifact_yields_violations(
    valid: dict[str, Path], kind: str, deep: bool, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / valid[kind].name
        if valid[kind].is_dir():
            shutil.copytree(valid[kind], root)
        else:
            shutil.copy2(valid[kind], root)
        data.draw(st.just(_damage(data, root)), label="damage")
        violations = outcome(READER, lambda: validate(root, deep=deep), refused=bool)
        assert isinstance(violations, list)
        assert all(isinstance(v, Violation) and v.message for v in violations), violations
