"""Every class of corruption is rejected with a message that names the problem and its place.

Hypothesis picks which artifact, file, tensor, field and value to damage; each test states
what the violation must mention.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from eagle3_schemas import validate
from eagle3_schemas.contract.registry import load_schema, versions

from support.edits import (
    artifact_files,
    load_tensors,
    rewrite_header,
    rewrite_parquet,
    rewrite_tensors,
)
from support.fixtures import BUILDERS, build

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = list(BUILDERS)  # every kind of artifact
TENSOR_KINDS = ["vocab_map", "hidden_states", "draft_checkpoint"]
NUMPY_DTYPES = {
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I32": np.int32,
    "I64": np.int64,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


@contextmanager
def artifact(kind: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield build(kind, Path(tmp))


def _draw_tensor(root: Path, data: st.DataObject) -> tuple[Path, str]:
    """One of the artifact's safetensors files, then one of its tensors: the file and the name."""
    path = data.draw(
        st.sampled_from([p for p in artifact_files(root) if p.suffix == ".safetensors"])
    )
    tensors, _ = load_tensors(path)
    return path, data.draw(st.sampled_from(sorted(tensors)))


def _messages(violations: list) -> str:
    return "\n".join(map(str, violations))


@SETTINGS
@given(kind=st.sampled_from(TENSOR_KINDS), data=st.data())
def test_wrong_dtype_is_rejected(kind: str, data: st.DataObject) -> None:
    with artifact(kind) as root:
        path, name = _draw_tensor(root, data)
        allowed = _allowed_dtypes(kind, path, name)
        new = data.draw(st.sampled_from(sorted(set(NUMPY_DTYPES) - set(allowed))))
        rewrite_tensors(path, lambda t: t.__setitem__(name, t[name].astype(NUMPY_DTYPES[new])))
        violations = validate(root)
        assert any(
            f"tensor {name}" in v.location and f"dtype {new}" in v.message for v in violations
        ), _messages(violations)


def _allowed_dtypes(kind: str, path: Path, name: str) -> list[str]:
    for spec in load_schema(kind)["files"].values():
        if (
            spec["format"] == "safetensors"
            and name in spec.get("tensors", {})
            and (spec["path"] == "." or path.match(spec["path"]))
        ):
            return spec["tensors"][name]["dtype"]
    raise AssertionError(f"{name} not in {kind} schema")


@SETTINGS
@given(kind=st.sampled_from(TENSOR_KINDS), data=st.data())
def test_missing_tensor_is_rejected(kind: str, data: st.DataObject) -> None:
    with artifact(kind) as root:
        path, name = _draw_tensor(root, data)
        rewrite_tensors(path, lambda t: t.pop(name))
        violations = validate(root)
        assert any(v.location == f"tensor {name}" and "missing" in v.message for v in violations), (
            _messages(violations)
        )


@SETTINGS
@given(kind=st.sampled_from(TENSOR_KINDS), data=st.data(), grow=st.booleans())
def test_shape_mismatch_is_rejected(kind: str, data: st.DataObject, grow: bool) -> None:
    with artifact(kind) as root:
        path, name = _draw_tensor(root, data)

        def reshape(t: dict[str, np.ndarray]) -> None:
            axis = t[name].ndim - 1  # the last axis: a size fixed by the header or config
            t[name] = (
                np.concatenate([t[name], np.take(t[name], [0], axis=axis)], axis=axis)
                if grow
                else np.delete(t[name], 0, axis=axis)
            )

        rewrite_tensors(path, reshape)
        violations = validate(root)
        assert violations, f"{kind}: {path.name}:{name} reshaped but accepted"
        assert any(name in str(v) for v in violations), _messages(violations)


@SETTINGS
@given(kind=st.sampled_from(KINDS), data=st.data(), fraction=st.floats(0.0, 0.98))
def test_truncated_file_is_rejected(kind: str, data: st.DataObject, fraction: float) -> None:
    with artifact(kind) as root:
        path = data.draw(st.sampled_from(artifact_files(root)))
        size = path.stat().st_size
        with open(path, "r+b") as f:
            f.truncate(int(size * fraction))
        violations = validate(root)
        assert violations, f"{path} truncated to {int(size * fraction)}/{size} bytes but accepted"
        named = [v for v in violations if path.name in str(v)]
        assert named, _messages(violations)


@SETTINGS
@given(
    kind=st.sampled_from(KINDS), data=st.data(), how=st.sampled_from(["delete", "empty", "null"])
)
def test_bad_lineage_is_rejected(kind: str, data: st.DataObject, how: str) -> None:
    key = data.draw(st.sampled_from(sorted(load_schema(kind)["lineage"]["required"])))
    with artifact(kind) as root:

        def damage(header: dict) -> None:
            if how == "delete":
                del header["lineage"][key]
            else:
                header["lineage"][key] = "" if how == "empty" else None

        rewrite_header(root, damage)
        violations = validate(root)
        assert any(v.location == f"header.lineage.{key}" for v in violations), _messages(violations)


@SETTINGS
@given(
    kind=st.sampled_from(KINDS),
    version=st.one_of(st.integers(-3, 1000), st.just("1"), st.none()),
)
def test_wrong_schema_version_is_rejected(kind: str, version: object) -> None:
    known = versions(kind)
    assume(version not in known)
    with artifact(kind) as root:
        rewrite_header(root, lambda h: h.__setitem__("schema_version", version))
        violations = validate(root)
        assert [v.location for v in violations] == ["header.schema_version"]
        assert repr(version) in violations[0].message and f"known: {known}" in violations[0].message


ESCAPES = [
    "../outside.safetensors",
    "/etc/passwd",
    "shards/../../outside.safetensors",
    "shards/../dataset.json",
    "elsewhere/x.safetensors",
    "..\\x",
    "",
]


@SETTINGS
@given(escape=st.sampled_from([*ESCAPES, "symlink"]), row=st.integers(0, 2))
def test_shard_path_escape_is_rejected(escape: str, row: int) -> None:
    with artifact("hidden_states") as root:
        if escape == "symlink":  # a shard inside shards/ that is a symlink leaving the dataset
            outside = root.parent / "outside.safetensors"
            outside.write_bytes((root / "shards/shard-00000.safetensors").read_bytes())
            (root / "shards/shard-00000.safetensors").unlink()
            os.symlink(outside, root / "shards/shard-00000.safetensors")
            target = "shards/shard-00000.safetensors"
            row = 0
        else:
            target = escape
        rewrite_parquet(root / "manifest.parquet", lambda m: m["shard"].__setitem__(row, target))
        violations = validate(root)
        hits = [v for v in violations if v.location == f"row {row}, column shard"]
        assert not [v for v in violations if "could not run" in v.message], _messages(violations)
        assert hits, _messages(violations)
        assert any(w in hits[0].message for w in ("outside", "relative", "must lie under")), hits[
            0
        ].message


@SETTINGS
@given(row=st.integers(0, 8), value=st.floats(0.25, 100) | st.floats(-100, -0.25))
def test_changed_shard_bytes_fail_the_row_checksum(row: int, value: float) -> None:
    with artifact("hidden_states") as root:
        shard = root / "shards/shard-00000.safetensors"  # rows 0-4 sample 0, rows 5-13 sample 1
        rewrite_tensors(
            shard,
            lambda t: t["last_hidden_state"].__setitem__(
                (row, 0), t["last_hidden_state"][row, 0] + value
            ),
        )
        violations = validate(root)
        sample_row = 0 if row < 5 else 1
        assert any(v.location == f"row {sample_row}, column checksum" for v in violations), (
            _messages(violations)
        )


@SETTINGS
@given(
    bad=st.sampled_from([np.nan, np.inf, -np.inf]),
    kind=st.sampled_from(["hidden_states", "draft_checkpoint"]),
)
def test_non_finite_values_are_rejected(bad: float, kind: str) -> None:
    with artifact(kind) as root:
        path, name = (
            (root / "shards/shard-00001.safetensors", "aux_hidden_states")
            if kind == "hidden_states"
            else (root / "model.safetensors", "fc.weight")
        )
        rewrite_tensors(path, lambda t: t[name].reshape(-1).__setitem__(3, bad))
        violations = validate(root)
        assert any(v.location == f"tensor {name}" and "NaN/Inf" in v.message for v in violations), (
            _messages(violations)
        )


def test_unsorted_d2t_is_rejected(tmp_path: Path) -> None:
    root = build("vocab_map", tmp_path)
    rewrite_tensors(root, lambda t: t.__setitem__("d2t", t["d2t"][::-1] + 0))
    violations = validate(root)
    assert any(
        v.location.startswith("tensor d2t[") and "sorted ascending" in v.message for v in violations
    ), _messages(violations)


def test_loss_mask_mismatch_names_row_and_column(tmp_path: Path) -> None:
    root = build("tokenized", tmp_path)
    rewrite_parquet(root, lambda c: c["loss_mask"].__setitem__(1, [2] * len(c["loss_mask"][1])))
    messages = _messages(validate(root))
    assert "column loss_mask: values [2] found, expected only 0 and 1" in messages
    assert "row 1, column num_loss_tokens" in messages


def test_roles_that_do_not_alternate_are_rejected(tmp_path: Path) -> None:
    root = build("conversations", tmp_path)
    rewrite_parquet(
        root, lambda c: c["messages"].__setitem__(0, [{"role": "assistant", "content": "hi"}])
    )
    violations = validate(root)
    assert [str(v).split(": ", 1)[1] for v in violations] == [
        "row 0, column messages: not_alternating: message 0: role 'assistant' where 'user' was expected (user and assistant alternate, user first)"
    ]


def test_inconsistent_acceptance_length_is_rejected(tmp_path: Path) -> None:
    root = build("eval_report", tmp_path)
    rewrite_header(root, lambda h: h.__setitem__("acceptance_length", h["acceptance_length"] + 0.5))
    assert any(v.location == "acceptance_length" for v in validate(root))


def test_a_group_whose_counts_are_not_its_rows_is_rejected(tmp_path: Path) -> None:
    root = build("eval_report", tmp_path)
    assert validate(root) == []
    rewrite_header(root, lambda h: h["groups"][0].__setitem__("num_drafts", 11))
    counts, figures = validate(root)  # its counts, and its AL no longer 1 + accepted/drafts
    assert counts.location == figures.location == "groups[0] (heldout/*)"
    assert "[2, 11, 15] but its samples.parquet rows sum to [2, 10, 15]" in counts.message


def test_checkpoint_vocab_map_fingerprint_must_match_its_tensors(tmp_path: Path) -> None:
    root = build("draft_checkpoint", tmp_path)
    rewrite_header(
        root, lambda h: h["lineage"].__setitem__("vocab_map_fingerprint", "sha256:" + "0" * 64)
    )
    violations = validate(root)
    assert any(
        v.location == "header.lineage.vocab_map_fingerprint" and "d2t/t2d fingerprint" in v.message
        for v in violations
    )


def test_unknown_kind_and_missing_path(tmp_path: Path) -> None:
    root = build("eval_report", tmp_path)
    rewrite_header(root, lambda h: h.__setitem__("artifact", "mystery"))
    assert [v.location for v in validate(root)] == ["header.artifact"]
    assert validate(tmp_path / "nope")[0].message == "does not exist"


def test_out_of_vocab_token_ids_name_their_row(tmp_path: Path) -> None:
    root = build("tokenized", tmp_path)
    rewrite_parquet(root, lambda c: c["input_ids"].__setitem__(2, [*c["input_ids"][2][:-1], 999]))
    violations = validate(root)
    assert [(v.location, v.message) for v in violations] == [
        ("row 2, column input_ids", "token ids [999] outside [0, 32)")
    ]
