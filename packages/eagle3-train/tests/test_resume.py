"""Resumable state: kill -9 a real training process after a checkpoint, resume it, and the
following steps' losses equal those of an uninterrupted run (same config, same processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from support.train import REPO, env_for_subprocess, make_inputs, run_cli, write_config

STEPS, SAVE, KILL_AFTER = 12, 4, 4


def _losses(run_dir) -> dict[int, float]:
    """Last logged train loss per step (a killed run may have logged steps it then lost)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "train":
            out[record["step"]] = record["loss"]
    return out


@pytest.mark.process
def test_kill_9_then_resume_reproduces_the_uninterrupted_losses(tmp_path):
    inputs = make_inputs(tmp_path / "inputs", num_samples=48, min_len=48, max_len=160, hidden=32)
    sections = dict(
        data={"max_tokens_per_batch": 384},
        train={
            "max_steps": STEPS,
            "save_every": SAVE,
            "epochs": 4,
            "log_every": 1,
            "keep_checkpoints": 3,
        },
    )
    straight = tmp_path / "straight"
    result = run_cli(
        ["--config", str(write_config(inputs, straight, **sections)), "--no-preflight"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    expected = _losses(straight)
    assert sorted(expected) == list(range(1, STEPS + 1))

    resumed = tmp_path / "resumed"
    config = write_config(inputs, resumed, **sections)
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagle3_train", "--config", str(config), "--no-preflight"],
        cwd=REPO,
        env=env_for_subprocess(),
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stderr is not None
    deadline = time.monotonic() + 240
    for line in proc.stderr:
        if "checkpoint saved: " in line and f"(step {KILL_AFTER})" in line:
            proc.send_signal(signal.SIGKILL)  # kill -9: no cleanup, no flush, no atexit
            break
        assert time.monotonic() < deadline, "no checkpoint line"
    proc.wait(timeout=60)
    proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    events = [
        json.loads(x).get("event") for x in (resumed / "metrics.jsonl").read_text().splitlines()
    ]
    assert "done" not in events, "the run finished before it was killed"
    assert json.loads((resumed / "checkpoints" / "latest.json").read_text())["step"] >= KILL_AFTER

    result = run_cli(["--config", str(config), "--no-preflight"])  # train.resume: auto
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stderr
    got = _losses(resumed)
    start = json.loads(
        [x for x in (resumed / "metrics.jsonl").read_text().splitlines() if '"start"' in x][-1]
    )["step"]
    assert start >= KILL_AFTER
    for step in range(start + 1, STEPS + 1):
        assert got[step] == expected[step], (
            f"step {step}: resumed {got[step]} vs straight {expected[step]}"
        )
    assert (resumed / "draft" / "config.json").is_file()
    assert not list((resumed / "checkpoints").glob(".tmp-*"))
