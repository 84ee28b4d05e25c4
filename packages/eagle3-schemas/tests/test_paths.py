"""The path rules every stage's CLI applies: the form of each artifact kind comes from its
schema, and each refusal names the argument, the path and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_schemas.contract.paths import (
    PathArgumentError,
    artifact_suffix,
    check_input_artifact,
    check_output_artifact,
)
from eagle3_schemas.contract.registry import artifact_kinds

from support import fixtures


@pytest.mark.parametrize("kind", artifact_kinds())
def test_each_kind_s_form_comes_from_its_schema_and_its_fixture_passes(
    kind: str, tmp_path: Path
) -> None:
    built = fixtures.build(kind, tmp_path)
    assert artifact_suffix(kind) == (None if built.is_dir() else built.suffix)
    check_input_artifact(built, kind, "--in")
    check_output_artifact(tmp_path / "new" / f"out{artifact_suffix(kind) or ''}", kind, "--out")
    with pytest.raises(PathArgumentError, match=rf"^--out {built}: already exists"):
        check_output_artifact(built, kind, "--out")


def test_suffixes_the_contract_gives() -> None:
    assert artifact_suffix("conversations") == ".parquet"
    assert artifact_suffix("vocab_map") == ".safetensors"
    assert artifact_suffix("hidden_states") is None


def test_an_input_of_another_kind_is_named(tmp_path: Path) -> None:
    tokenized = fixtures.build("tokenized", tmp_path)
    with pytest.raises(PathArgumentError) as info:
        check_input_artifact(tokenized, "conversations", "conversations")
    assert str(info.value) == (
        f"conversations {tokenized}: is a tokenized artifact; "
        "expected a conversations artifact (a .parquet file)"
    )
