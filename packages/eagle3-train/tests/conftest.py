"""Fixtures; the helpers themselves live in eagle3_train.testing (importable from any test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3_train.testing import Inputs, make_inputs


@pytest.fixture
def inputs(tmp_path: Path) -> Inputs:
    return make_inputs(tmp_path / "inputs")
