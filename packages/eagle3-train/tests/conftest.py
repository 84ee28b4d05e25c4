"""Fixtures; the helpers themselves live in support.train (importable from any test)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState

from eagle3_train.cli import main

from support.train import Inputs, make_inputs


@pytest.fixture
def inputs(tmp_path: Path) -> Inputs:
    return make_inputs(tmp_path / "inputs")


@pytest.fixture
def in_process():
    """Run the CLI in this process, then undo its global state (threads, Accelerate)."""
    threads = torch.get_num_threads()
    yield main
    torch.set_num_threads(threads)
    AcceleratorState._reset_state(reset_partial_state=True)
