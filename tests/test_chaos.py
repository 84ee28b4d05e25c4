"""A bounded chaos round: ``tools/chaos/run_chaos.py`` over the agent pipeline (ingest of tool
calls → tokenize → vocab → extract → train), one round, each stage killed once (kill -9 or
SIGTERM, at a moment the seed picks) and resumed with the same command, then compared with an
unkilled run: every artifact validates and has the unkilled run's content id (the draft bit for
bit), no row lost or doubled, no torn file, only documented exit statuses. The 200-kill run and
the 2-process launches are the tool's, by hand (docs/testing.md).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.train import REPO, env_for_subprocess

# ~2 min on 2 idle cores (the unkilled run, then the killed one): room for a busy machine.
pytestmark = [pytest.mark.process, pytest.mark.slow, pytest.mark.timeout(600)]

STAGES = ("ingest", "tokenize", "vocab", "extract", "train")


def test_a_chaos_round_kills_every_stage_and_ends_equal_to_the_unkilled_run(
    tmp_path: Path,
) -> None:
    command = [sys.executable, str(REPO / "tools" / "chaos" / "run_chaos.py")]
    command += ["--pipeline", "agent", "--rounds", "1", "--kills", "1", "--seed", "3"]
    began = time.monotonic()
    done = subprocess.run(
        [*command, "--work", str(tmp_path / "chaos")],
        cwd=REPO,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
    )
    took = time.monotonic() - began
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    table = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line}
    for stage in STAGES:  # kill -9, SIGTERM, resumed, lost, doubled, torn, hit a write
        row = table[stage]
        assert row[4:7] == ["0", "0", "0"], row
    summary = re.search(r"all +(\d+) kills, (\d+) while a file", done.stdout)
    assert summary is not None and int(summary.group(1)) >= 3, done.stdout
    assert "0 problems" in done.stdout, done.stdout
    print(f"chaos round: {summary.group(1)} kills in {took:.0f} s")
