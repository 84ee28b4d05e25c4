"""Valid artifacts of every kind validate, and their headers and tensors read back unchanged."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import xxhash

from eagle3_schemas import fingerprint_artifact, fingerprint_vocab_map, read_header, validate
from eagle3_schemas.contract.registry import artifact_kinds, versions
from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_schemas.layouts.hidden_states import checksum_rows

from support.edits import as_hidden_states_v1, rewrite_header
from support.fixtures import BUILDERS, build, vocab_arrays


def test_every_schema_kind_has_a_fixture() -> None:
    assert sorted(BUILDERS) == artifact_kinds()


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_fixture_validates_and_header_round_trips(kind: str, tmp_path: Path) -> None:
    path = build(kind, tmp_path)
    assert validate(path) == []
    header = read_header(path)
    assert header.artifact == kind
    assert header.schema_version == versions(kind)[-1]  # writers write the newest version
    assert header.lineage  # every artifact records where it came from
    assert fingerprint_artifact(path).startswith("sha256:")


def test_a_v1_draft_checkpoint_still_validates(tmp_path: Path) -> None:
    """draft_checkpoint v2 added the MLA variant; a Llama draft written as v1 (no
    'architecture' in eagle3.json) is still read, against v1's rules."""
    path = build("draft_checkpoint", tmp_path)
    header = json.loads((path / "eagle3.json").read_text())
    header["schema_version"] = 1
    del header["architecture"]
    (path / "eagle3.json").write_text(json.dumps(header))
    assert validate(path) == []
    assert read_header(path).schema_version == 1


def test_a_v1_hidden_state_dataset_still_validates_with_its_own_checksum(tmp_path: Path) -> None:
    """hidden_states v2 changed the row checksum (XXH3-128 for blake2b-128); a v1 dataset is
    read with v1's rule, and each version refuses the other's checksums."""
    path = build("hidden_states", tmp_path)
    checksums = pq.read_table(path / "manifest.parquet").column("checksum").to_pylist()
    assert all(c.startswith("xxh3_128:") and len(c) == 9 + 32 for c in checksums)
    as_hidden_states_v1(path)
    assert read_header(path).schema_version == 1
    v1_checksums = pq.read_table(path / "manifest.parquet").column("checksum").to_pylist()
    assert all(c.startswith("blake2b:") for c in v1_checksums)
    assert validate(path) == []

    rewrite_header(path, lambda h: h.__setitem__("schema_version", 2))  # v1 sums, v2 header
    violations = validate(path)
    assert violations and all("is not a xxh3_128 checksum" in v.message for v in violations)
    assert {v.location for v in violations} == {
        f"row {i}, column checksum" for i in range(len(checksums))
    }


def test_row_checksums_are_the_documented_hashes() -> None:
    """The schema files' words, computed independently: v2 = XXH3-128 (xxhash), v1 =
    blake2b-128 (hashlib), over the per-token tensors' bytes in name order."""
    rows = {"loss_mask": b"\x01\x00", "input_ids": b"abcdefgh", "cu_seqlens": b"ignored"}
    joined = rows["input_ids"] + rows["loss_mask"]
    assert checksum_rows(rows) == "xxh3_128:" + xxhash.xxh3_128(joined).hexdigest()
    assert (
        checksum_rows(rows, 1) == "blake2b:" + hashlib.blake2b(joined, digest_size=16).hexdigest()
    )


def test_vocab_map_tensors_round_trip(tmp_path: Path) -> None:
    path = build("vocab_map", tmp_path)
    counts, d2t, t2d = vocab_arrays()
    st = read_safetensors(path)
    np.testing.assert_array_equal(st.array("token_counts"), counts)
    np.testing.assert_array_equal(st.array("d2t"), d2t)
    np.testing.assert_array_equal(st.array("t2d"), t2d)
    # target = i + d2t[i], ascending, and t2d marks exactly those targets
    targets = np.arange(len(d2t)) + d2t
    assert np.all(np.diff(targets) > 0)
    assert set(np.flatnonzero(t2d)) == set(targets)


def test_vocab_map_fingerprint_is_recomputable_from_the_checkpoint(tmp_path: Path) -> None:
    vocab = build("vocab_map", tmp_path)
    draft = build("draft_checkpoint", tmp_path)
    weights = read_safetensors(draft / "model.safetensors")
    assert fingerprint_artifact(vocab) == fingerprint_vocab_map(
        weights.array("d2t"), weights.array("t2d")
    )
    assert read_header(draft).lineage["vocab_map_fingerprint"] == fingerprint_artifact(vocab)


def test_tokenized_columns_round_trip(tmp_path: Path) -> None:
    path = build("tokenized", tmp_path)
    table = pq.read_table(path)
    for ids, mask, n in zip(
        *(table.column(c).to_pylist() for c in ("input_ids", "loss_mask", "num_tokens")),
        strict=True,
    ):
        assert len(ids) == len(mask) == n
