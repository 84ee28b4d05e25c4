"""The faults a long run meets, each a named behaviour (issue 25): a non-finite step skipped
(train.on_non_finite: skip), a damaged shard row (checked as it is read; data.on_corrupt),
preemption by a signal (checkpoint at the step boundary, exit 5, exact resume)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from eagle3_schemas.contract.header import write_safetensors
from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_train.data.dataset import CorruptSample, HiddenStateDataset
from eagle3_train.data.loader import ShardReader
from eagle3_train.run.nonfinite import NonFiniteSkip, fused_found_inf

from support.edits import rewrite_checksums
from support.smallfs import leave_free, small_tmpfs
from support.synthetic_states import write_dataset
from support.train import (
    REPO,
    Inputs,
    env_for_subprocess,
    make_inputs,
    read_metrics,
    run_cli,
    write_config,
)


def _records(run: Path) -> list[dict]:
    """Every line of a finished run's metrics: each must be whole."""
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _poison(dataset: Path, sample_ids: set[str] | None) -> list[str]:
    """Set the stored final states of ``sample_ids`` (None: every sample) to inf in place, as
    a target that produced them would have (checksummed as written)."""
    manifest = pq.read_table(dataset / "manifest.parquet").to_pylist()
    rows = [r for r in manifest if sample_ids is None or r["sample_id"] in sample_ids]
    for shard in sorted({r["shard"] for r in rows}):
        tensors = load_file(str(dataset / shard))
        for r in rows:
            if r["shard"] == shard:
                start, n = r["row_start"], r["num_tokens"]
                tensors["last_hidden_state"][start : start + n] = float("inf")
        write_safetensors(dataset / shard, tensors)
    rewrite_checksums(dataset)
    return [r["sample_id"] for r in rows]


def _weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step-{step:08d}" / "model.safetensors"))


# ---------------------------------------------------------------------------------------
# A NaN: skip mode


def test_skip_mode_skips_the_bad_steps_names_their_samples_and_changes_no_weight(
    tmp_path, in_process
):
    inputs = make_inputs(tmp_path / "inputs", num_samples=24, samples_per_shard=8)
    (bad,) = _poison(inputs.hidden_states, {"synthetic-000005"})
    run = tmp_path / "run"
    config = write_config(
        inputs,
        run,
        data={"validation_fraction": 0.0},
        train={
            "max_steps": None,
            "epochs": 2,
            "save_every": 1,
            "keep_checkpoints": 100,
            "on_non_finite": "skip",
            "max_skips_in_row": 2,
        },
    )
    assert in_process(["--config", str(config), "--no-preflight"]) == 0
    records = _records(run)
    skips = [r for r in records if r["event"] == "skip"]
    assert len(skips) == 2 and all(bad in r["sample_ids"] for r in skips)  # once per epoch
    assert all(r["what"] == "loss" and r["in_row"] == 1 for r in skips)
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert losses and all(math.isfinite(x) for x in losses)
    assert records[-1]["event"] == "done"
    for skip in skips:  # the skipped step changed no weight; the next one did
        before, at = _weights(run, skip["step"] - 1), _weights(run, skip["step"])
        assert all(torch.equal(before[k], at[k]) for k in before)
    at, after = _weights(run, skips[0]["step"]), _weights(run, skips[0]["step"] + 1)
    assert any(not torch.equal(at[k], after[k]) for k in at)


def test_skip_mode_stops_after_n_bad_steps_in_a_row(tmp_path, in_process):
    inputs = make_inputs(tmp_path / "inputs", num_samples=24, samples_per_shard=8)
    _poison(inputs.hidden_states, None)
    run = tmp_path / "run"
    config = write_config(
        inputs,
        run,
        data={"validation_fraction": 0.0},
        train={"on_non_finite": "skip", "max_skips_in_row": 3, "save_every": 2},
    )
    assert in_process(["--config", str(config), "--no-preflight"]) == 3
    records = _records(run)
    assert [r["in_row"] for r in records if r["event"] == "skip"] == [1, 2, 3]
    (stop,) = [r for r in records if r["event"] == "nan"]
    assert stop["step"] == 3
    assert "3 optimizer steps in a row" in stop["message"]
    assert "train.max_skips_in_row = 3" in stop["message"]
    # step 2's checkpoint was written (a skipped step keeps the weights as they were)
    assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 2
    assert not (run / "draft").exists()


class _OneProcess:
    num_processes, process_index, is_main_process = 1, 0, True


def test_the_fused_adamw_takes_the_verdict_on_the_device(tmp_path):
    """With torch's fused AdamW the skip is the kernel's own found_inf (no host read of the
    verdict: CUDA's path, exercised here by the CPU fused kernel)."""
    param = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.AdamW([param], lr=0.1, fused=True)
    assert fused_found_inf(optimizer)
    assert not fused_found_inf(torch.optim.AdamW([param], lr=0.1))
    skip = NonFiniteSkip(_OneProcess(), lag=2, max_in_row=5)
    metrics = tmp_path / "metrics.jsonl"
    from eagle3_train.run.nonfinite import BadStep

    for step, value in enumerate([1.0, float("nan"), 2.0], start=1):
        param.grad = torch.full((8,), value)
        where = BadStep("loss", torch.tensor(value), step, 0, step - 1, [f"s{step}"])
        skip.record(torch.tensor(value), where, metrics, None)
        before = param.detach().clone()
        skip.step_optimizer(optimizer)
        assert not hasattr(optimizer, "found_inf")
        changed = not torch.equal(before, param.detach())
        assert changed == math.isfinite(value)
        skip.end_step(metrics, None)
    assert int(optimizer.state[param]["step"]) == 2  # the skipped step is not counted
    assert len(skip.pending) == 2 and not metrics.exists()  # read two steps late
    skip.drain(metrics, None)
    (record,) = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert record["step"] == 2 and record["sample_ids"] == ["s2"]


# ---------------------------------------------------------------------------------------
# A damaged shard: rows checked as they are read


def _flip(dataset: Path, sample_id: str, tensor: str, row: int) -> tuple[Path, dict]:
    """Flip one bit of ``tensor``'s row ``row`` (counted within the sample) in place."""
    (entry,) = [
        r
        for r in pq.read_table(dataset / "manifest.parquet").to_pylist()
        if r["sample_id"] == sample_id
    ]
    path = dataset / entry["shard"]
    info = read_safetensors(path).tensors[tensor]
    row_bytes = (info.end - info.start) // info.shape[0]
    offset = info.start + (entry["row_start"] + row) * row_bytes + row_bytes // 2
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))
    return path, entry


def test_the_loader_checks_whole_rows_even_of_a_sample_cut_to_the_batch(tmp_path):
    root = write_dataset(
        tmp_path / "hs", num_samples=6, min_len=30, max_len=40, storage_dtype="bfloat16"
    )
    ds = HiddenStateDataset(root)
    plan = [(i, 20) for i in range(len(ds))]  # every sample longer than what the batch takes
    ShardReader(ds, verify="stop").read(plan)  # sound rows pass, prefix and rest hashed
    path, entry = _flip(root, ds.sample_ids[3], "aux_hidden_states", 25)  # past the cut
    with pytest.raises(CorruptSample) as stop:
        ShardReader(ds, verify="stop").read(plan)
    message = str(stop.value)
    rows = f"rows {entry['row_start']}..{entry['row_start'] + entry['num_tokens'] - 1}"
    assert str(path) in message and repr(ds.sample_ids[3]) in message and rows in message
    assert "data.on_corrupt: skip" in message
    unchecked = ShardReader(ds).read(plan)  # (the damage passes unseen)
    batch = ShardReader(ds, verify="skip").read(plan)
    (problem,) = batch["corrupt"]
    assert problem["sample_id"] == ds.sample_ids[3]
    cut = slice(3 * 20, 4 * 20)  # the skipped sample has no loss token and zero states
    assert not batch["loss_mask"][cut].any() and not batch["aux_hidden_states"][cut].any()
    others = torch.ones(len(plan) * 20, dtype=torch.bool)  # every other sample: as read
    others[cut] = False
    rows = {k: v for k, v in unchecked.items() if torch.is_tensor(v) and len(v) == len(others)}
    assert {"input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state"} <= set(rows)
    for name, tensor in rows.items():
        assert torch.equal(batch[name][others], tensor[others]), name


def test_a_flipped_byte_stops_the_run_naming_shard_sample_and_rows(tmp_path, in_process, caplog):
    inputs = make_inputs(tmp_path / "inputs", num_samples=24, samples_per_shard=8)
    path, entry = _flip(inputs.hidden_states, "synthetic-000013", "last_hidden_state", 2)
    run = tmp_path / "run"
    # a dataset too large to re-hash before each run: the loader is the only check
    train = {"validate_inputs": False, "max_steps": None, "save_every": 2}
    config = write_config(inputs, run, data={"validation_fraction": 0.0}, train=train)
    assert in_process(["--config", str(config)]) == 6
    assert str(path) in caplog.text and "'synthetic-000013'" in caplog.text
    assert f"rows {entry['row_start']}.." in caplog.text
    assert not (run / "draft").exists()
    logged = [r["step"] for r in _records(run) if r["event"] == "train"]
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    assert 0 < latest <= max(logged)
    # mended (the bit flipped back): the rerun resumes from the last checkpoint and finishes
    _flip(inputs.hidden_states, "synthetic-000013", "last_hidden_state", 2)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert in_process(["--config", str(config)]) == 0
    starts = [r for r in _records(run) if r["event"] == "start"]
    assert starts[-1]["step"] == latest and _records(run)[-1]["event"] == "done"


def test_on_corrupt_skip_trains_without_the_sample_and_counts_it(tmp_path, in_process):
    """Also: the steps before the batch that holds the damaged sample are the clean run's,
    loss for loss, bit for bit (skipping changes nothing it does not have to)."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=24, samples_per_shard=8)
    train = {"validate_inputs": False, "max_steps": None, "epochs": 2, "save_every": 0}
    data = {"validation_fraction": 0.0, "on_corrupt": "skip"}
    clean = tmp_path / "clean"
    assert in_process(["--config", str(write_config(inputs, clean, data=data, train=train))]) == 0
    AcceleratorState._reset_state(reset_partial_state=True)
    _flip(inputs.hidden_states, "synthetic-000013", "input_ids", 0)
    run = tmp_path / "run"
    config = write_config(inputs, run, data=data, train=train)
    assert in_process(["--config", str(config)]) == 0
    records = _records(run)
    bad_step = next(r["step"] for r in records if r["event"] == "corrupt")
    before = [(step, loss) for step, loss in _series(run) if step < bad_step]
    assert len(before) >= 2 and before == _series(clean)[: len(before)]
    corrupt = [r for r in records if r["event"] == "corrupt"]
    assert [r["sample_id"] for r in corrupt] == ["synthetic-000013"] * 2  # once per epoch
    assert corrupt[0]["expected"] != corrupt[0]["found"]
    logged = [
        r["corrupt_samples"] for r in records if "corrupt_samples" in r and r["event"] == "train"
    ]
    assert sum(logged) == 2
    assert records[-1]["event"] == "done" and records[-1]["corrupt_samples"] == 2
    losses = [r["loss"] for r in records if r["event"] == "train"]
    assert all(math.isfinite(x) for x in losses)


# ---------------------------------------------------------------------------------------
# Preemption: a signal, a checkpoint at the step boundary, exit 5, an exact resume


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ended early ({proc.returncode}):\n{log.read_text()[-3000:]}"
        metrics = run / "metrics.jsonl"
        if metrics.is_file() and any(
            r["event"] == "train" and r["step"] >= step for r in read_metrics(metrics)
        ):
            return
        time.sleep(0.01)
    raise AssertionError(f"step {step} not logged within 120 s:\n{log.read_text()[-3000:]}")


def _series(run: Path) -> list[tuple[int, float]]:
    """(step, loss) in the order logged. Steps an attempt logged past the checkpoint the next
    attempt resumed from are dropped (they were redone); anything else logged twice stays
    twice, where a dict keyed by step would hide it."""
    series: list[tuple[int, float]] = []
    for record in _records(run):
        if record["event"] == "start":
            series = [(step, loss) for step, loss in series if step <= record["step"]]
        elif record["event"] == "train":
            series.append((record["step"], record["loss"]))
    return series


def _same_draft(a: Path, b: Path) -> None:
    wa, wb = (
        load_file(str(a / "draft" / "model.safetensors")),
        load_file(str(b / "draft" / "model.safetensors")),
    )
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.process
def test_sigterm_checkpoints_at_the_step_and_the_rerun_resumes_bit_equal(tmp_path):
    inputs = make_inputs(tmp_path / "inputs", num_samples=48)
    train = {"max_steps": 40, "epochs": 10, "save_every": 0, "log_every": 1}
    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    result = run_cli(["--config", str(write_config(inputs, straight, train=train))])
    assert result.returncode == 0, result.stderr[-3000:]
    config = write_config(inputs, preempted, train=train)
    log = tmp_path / "preempted.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "eagle3_train", "--config", str(config)],
            cwd=REPO,
            env=env_for_subprocess(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            _wait_for_step(preempted, 3, proc, log)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 5, log.read_text()[-3000:]
        finally:
            proc.kill()
    (stop,) = [r for r in _records(preempted) if r["event"] == "preempted"]
    assert 3 <= stop["step"] < 40 and "SIGTERM" in stop["message"]
    assert _series(preempted)[-1][0] == stop["step"]  # the step in flight was finished
    latest = json.loads((preempted / "checkpoints" / "latest.json").read_text())
    assert latest["step"] == stop["step"]
    assert not (preempted / "draft").exists()
    result = run_cli(["--config", str(config)])  # the same command resumes
    assert result.returncode == 0, result.stderr[-3000:]
    starts = [r for r in _records(preempted) if r["event"] == "start"]
    assert starts[-1]["step"] == stop["step"]
    assert _series(preempted) == _series(straight)  # every step once, bit-equal
    _same_draft(preempted, straight)


def _descendant_with_rank(root_pid: int, rank: int) -> int | None:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        for child in children.get(pid, []):
            try:
                env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"eagle3_train" in cmd:
                return child
            todo.append(child)
    return None


@pytest.mark.distributed
@pytest.mark.slow
def test_a_signal_to_one_rank_of_two_stops_both_at_one_step_and_resumes_bit_equal(tmp_path):
    """2-process DDP launch, train.preempt_signals [SIGUSR1] (Slurm's --signal=USR1@lead);
    the signal goes to rank 1 only."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    inputs = make_inputs(tmp_path / "inputs", num_samples=64, min_len=24, max_len=96)
    train = {"max_steps": 40, "epochs": 10, "save_every": 0, "log_every": 1}
    train["preempt_signals"] = ["SIGUSR1"]

    def launch(run: Path, log: Path) -> subprocess.Popen:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [accelerate, "launch", "--config_file", "recipes/accelerate/ddp.yaml"]
        cmd += ["--main_process_port", str(port), "-m", "eagle3_train"]
        cmd += ["--config", str(write_config(inputs, run, train=train))]
        with log.open("a") as err:
            return subprocess.Popen(
                cmd, cwd=REPO, env=env_for_subprocess(), stdout=subprocess.DEVNULL, stderr=err
            )

    straight, preempted = tmp_path / "straight", tmp_path / "preempted"
    logs = {name: tmp_path / f"{name}.log" for name in ("straight", "preempted")}
    proc = launch(straight, logs["straight"])
    assert proc.wait(timeout=400) == 0, logs["straight"].read_text()[-4000:]
    proc = launch(preempted, logs["preempted"])
    try:
        _wait_for_step(preempted, 3, proc, logs["preempted"])
        rank1 = _descendant_with_rank(proc.pid, 1)
        assert rank1 is not None, "rank 1's process not found"
        os.kill(rank1, signal.SIGUSR1)
        code = proc.wait(timeout=400)
    finally:
        proc.kill()
    text = logs["preempted"].read_text()
    # torchrun (under accelerate launch) ends with 1 when a rank ends non-zero and reports
    # each rank's status: 5, or for the later one SIGTERM from torchrun itself when the first
    # had already left — both after the barrier that follows the complete checkpoint
    assert code == 1 and "exitcode  : 5" in text, text[-4000:]
    assert text.count("exitcode  : 5") + text.count("exitcode  : -15") == 2, text[-4000:]
    (stop,) = [r for r in _records(preempted) if r["event"] == "preempted"]
    assert "another rank" in stop["message"]  # rank 0 was not signalled, and stopped too
    assert "preempted by SIGUSR1 (rank 1)" in text
    assert (
        json.loads((preempted / "checkpoints" / "latest.json").read_text())["step"] == stop["step"]
    )
    proc = launch(preempted, logs["preempted"])
    assert proc.wait(timeout=400) == 0, logs["preempted"].read_text()[-4000:]
    assert _series(preempted) == _series(straight)
    _same_draft(preempted, straight)


# ---------------------------------------------------------------------------------------
# A full disk: a real small tmpfs under the run's output


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.fixture
def reference(tmp_path, in_process):
    """A run on the ordinary disk: its loss series and the sizes of what it writes."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=48)
    train = {"max_steps": 4, "save_every": 2, "keep_checkpoints": 1}
    run = tmp_path / "reference"
    assert in_process(["--config", str(write_config(inputs, run, train=train))]) == 0
    AcceleratorState._reset_state(reset_partial_state=True)
    sizes = {
        "checkpoint": _size(run / "checkpoints" / f"step-{4:08d}"),
        "export": _size(run / "draft"),
        "other": (run / "metrics.jsonl").stat().st_size + (run / "run.yaml").stat().st_size,
    }
    return inputs, train, _series(run), sizes


@pytest.mark.tmpfs
def test_no_room_for_the_next_checkpoint_stops_before_writing_it(
    tmp_path, in_process, reference, caplog
):
    inputs, train, series, sizes = reference
    with small_tmpfs(tmp_path / "small") as disk:
        run = disk / "run"
        # room for one checkpoint and a half: the second does not fit
        filler = leave_free(disk, sizes["checkpoint"] * 3 // 2 + sizes["other"] + (16 << 10))
        config = write_config(inputs, run, train=train)
        assert in_process(["--config", str(config)]) == 7
        text = caplog.text
        assert f"{run / 'checkpoints'}: no room for checkpoint step-{4:08d}" in text
        assert "needs about" in text and "free on that filesystem" in text
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
            "latest.json",
            f"step-{2:08d}",
        ]  # no temporary directory left, the last good checkpoint intact
        filler.unlink()  # space freed: the same command resumes from step 2
        AcceleratorState._reset_state(reset_partial_state=True)
        assert in_process(["--config", str(config)]) == 0
        starts = [r for r in _records(run) if r["event"] == "start"]
        assert starts[-1]["step"] == 2
        assert _series(run) == series


@pytest.mark.tmpfs
def test_a_full_disk_during_the_export_keeps_nothing_half_written(
    tmp_path, in_process, reference, caplog
):
    inputs, train, series, sizes = reference
    train = {**train, "save_every": 4}  # one checkpoint (step 4), then the export
    with small_tmpfs(tmp_path / "small") as disk:
        run = disk / "run"
        filler = leave_free(
            disk, sizes["checkpoint"] + sizes["other"] + sizes["export"] // 2 + (16 << 10)
        )
        config = write_config(inputs, run, train=train)
        assert in_process(["--config", str(config)]) == 7
        text = caplog.text
        assert f"{run / 'exports' / f'step-{4:08d}'}: no room for export step-{4:08d}" in text
        assert "No space left on device" in text and "needs about" in text
        assert not (run / "draft").exists()
        exports = run / "exports"
        assert not exports.exists() or not list(exports.iterdir())  # no half export
        assert json.loads((run / "checkpoints" / "latest.json").read_text())["step"] == 4
        filler.unlink()
        AcceleratorState._reset_state(reset_partial_state=True)
        assert in_process(["--config", str(config)]) == 0
        assert _series(run) == series
        assert _records(run)[-1]["event"] == "done"


@pytest.mark.tmpfs
def test_a_full_disk_while_logging_metrics_stops_by_name_and_the_rerun_drops_the_torn_line(
    tmp_path, in_process, caplog
):
    """metrics.jsonl alone lies on a real tmpfs with one page (4 KiB) left (a symlink from the
    run directory: the disk fills while a metrics line is appended, not while a checkpoint is
    written). The line that does not fit stops the run (exit 7, the file named), the complete
    lines before it are kept and the torn one is left out by the reader; once space is freed
    the same command drops the torn line, resumes from the last checkpoint and logs what a run
    without the fault logs, bit for bit."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=48)
    train = {"max_steps": 12, "save_every": 2, "keep_checkpoints": 1}
    straight = tmp_path / "straight"
    assert in_process(["--config", str(write_config(inputs, straight, train=train))]) == 0
    AcceleratorState._reset_state(reset_partial_state=True)
    run = tmp_path / "run"
    config = write_config(inputs, run, train=train)
    with small_tmpfs(tmp_path / "small", size_mib=1) as disk:
        run.mkdir()
        metrics = run / "metrics.jsonl"
        metrics.symlink_to(disk / "metrics.jsonl")
        filler = leave_free(disk, 4096)
        assert in_process(["--config", str(config)]) == 7
        assert f"{metrics}: no room for the 'train' line of step" in caplog.text
        assert "No space left on device" in caplog.text
        data = metrics.read_bytes()
        assert len(data) == 4096 and not data.endswith(b"\n")  # ENOSPC cut the last line
        kept = read_metrics(metrics)
        assert len(kept) == data.count(b"\n") and kept[-1]["event"] == "train"
        torn_step = kept[-1]["step"] + 1
        last = json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
        assert 2 <= last < torn_step <= 12 and not (run / "draft").exists()

        filler.unlink()
        caplog.clear()
        AcceleratorState._reset_state(reset_partial_state=True)
        assert in_process(["--config", str(config)]) == 0
        assert f"{metrics}: dropping a torn last line" in caplog.text
        records = _records(run)  # every line whole again
        assert [r["step"] for r in records if r["event"] == "start"] == [0, last]
        assert _series(run) == _series(straight)
        assert records[-1]["event"] == "done"
        _same_draft(run, straight)


# ---------------------------------------------------------------------------------------
# A dead rank: 2-process ZeRO-2 on two "machines" (one launcher each, as docs/multinode.md)


ZERO2_TRAIN = {"max_steps": 60, "epochs": 20, "save_every": 2, "log_every": 1}
ZERO2_TRAIN["collective_timeout_s"] = 5


def _launch_two_machines(config: Path, logs: list[Path]) -> list[subprocess.Popen]:
    """``accelerate launch`` of ZeRO-2 once per "machine" (one process each), as docs/multinode.md."""
    accelerate = str(Path(sys.executable).parent / "accelerate")
    env = {**env_for_subprocess(), "DS_ACCELERATOR": "cpu"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [accelerate, "launch", "--config_file", "recipes/accelerate/zero2_multinode.yaml"]
    cmd += ["--num_machines", "2", "--num_processes", "2"]
    cmd += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    procs = []
    for r in (0, 1):
        with logs[r].open("a") as err:
            command = [*cmd, "--machine_rank", str(r), "-m", "eagle3_train"]
            command += ["--config", str(config)]
            procs.append(
                subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
            )
    return procs


def _both_end_zero(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Each machine's launch exits 0; on the first that does not, the other is ended too, so
    that no launch outlives the test."""
    try:
        for r, p in enumerate(procs):
            assert p.wait(timeout=400) == 0, logs[r].read_text()[-4000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=120)


@pytest.fixture(scope="module")
def zero2_straight(tmp_path_factory) -> tuple[Inputs, Path]:
    """The two-machine ZeRO-2 run without a fault: what a relaunched run must reproduce. It
    tests no timeout: its collectives may wait longer than 5 s, as a rank of two launches on a
    shared 2-core machine can fall that far behind (the losses and the draft do not depend on it)."""
    tmp_path = tmp_path_factory.mktemp("zero2")
    inputs = make_inputs(tmp_path / "inputs", num_samples=64, min_len=24, max_len=96)
    run = tmp_path / "straight"
    logs = [tmp_path / f"machine{r}.log" for r in (0, 1)]
    train = {**ZERO2_TRAIN, "collective_timeout_s": 300}
    _both_end_zero(_launch_two_machines(write_config(inputs, run, train=train), logs), logs)
    return inputs, run


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_a_dead_or_frozen_rank_stops_the_survivor_in_bounded_time_and_the_rerun_resumes(
    tmp_path, fault, zero2_straight
):
    """kill -9 of rank 1 (its connections close) or SIGSTOP (alive, silent: only the collective
    timeout can tell): rank 0 stops within train.collective_timeout_s (5 s here) plus a margin,
    exit 8, naming what happened and the last checkpoint; relaunched, the run resumes there and
    ends as the run without a fault: the same loss at every step and the same draft, bit for
    bit."""
    inputs, straight = zero2_straight
    run = tmp_path / "run"
    config = write_config(inputs, run, train=ZERO2_TRAIN)
    # an earlier attempt's record of rank 1's fault: not this attempt's cause (causes.py)
    (run / "faults").mkdir(parents=True)
    stale = {"rank": 1, "status": 6, "message": "damaged shard: an earlier attempt"}
    (run / "faults" / "rank-1.json").write_text(json.dumps(stale))
    logs = [tmp_path / f"machine{r}.log" for r in (0, 1)]
    procs = _launch_two_machines(config, logs)
    victim = None
    try:
        _wait_for_step(run, 5, procs[0], logs[0])
        victim = _descendant_with_rank(procs[1].pid, 1)
        assert victim is not None, "rank 1's process not found"
        os.kill(victim, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        hit = time.monotonic()
        procs[0].wait(timeout=120)
        took = time.monotonic() - hit
    finally:
        if victim is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        if procs[0].poll() is None:
            procs[0].kill()
        procs[1].wait(timeout=120)
    text = logs[0].read_text()
    assert took < 5 + 25, f"rank 0 took {took:.0f} s to stop"
    assert "exitcode  : 8" in text, text[-4000:]
    # a collective on the default group fails (a killed peer's connections close; a frozen
    # one times out), or rank 0 waits inside DeepSpeed's own groups and the watchdog ends it
    assert (
        "rank 0: a collective with the other ranks failed" in text
        or "rank 0: no training step finished for" in text
    ), text[-4000:]
    assert "train.collective_timeout_s=5 s" in text
    assert "an earlier attempt" not in text
    last = json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    assert f"last checkpoint: {run / 'checkpoints' / f'step-{last:08d}'}" in text
    _both_end_zero(_launch_two_machines(config, logs), logs)  # the same command resumes
    starts = [r for r in _records(run) if r["event"] == "start"]
    assert starts[-1]["step"] == last and _records(run)[-1]["event"] == "done"
    assert _series(run) == _series(straight)  # every step once, bit-equal
    _same_draft(run, straight)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_corrupt_sample_on_one_rank_stops_every_rank_with_its_status_naming_the_rank(tmp_path):
    """Two "machines" (one launcher each, so no launcher ends the other rank), ZeRO-2,
    data.on_corrupt: stop and one damaged sample that only the loader sees: the rank that
    reads it stops with exit 6 naming shard and sample; the other, whose collective with it
    fails, reads what it left under OUTPUT/faults and exits 6 too, naming that rank, not 8.
    Records an earlier attempt left (exit 7 here) are not read as this one's."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=64, min_len=24, max_len=96)
    _flip(inputs.hidden_states, "synthetic-000013", "last_hidden_state", 2)
    run = tmp_path / "run"
    for rank in (0, 1):  # an earlier attempt's records
        stale = {"rank": rank, "status": 7, "message": "disk full: an earlier attempt"}
        (run / "faults").mkdir(parents=True, exist_ok=True)
        (run / "faults" / f"rank-{rank}.json").write_text(json.dumps(stale))
    train = {**ZERO2_TRAIN, "validate_inputs": False}
    config = write_config(inputs, run, data={"validation_fraction": 0.0}, train=train)
    logs = [tmp_path / f"machine{r}.log" for r in (0, 1)]
    procs = _launch_two_machines(config, logs)
    try:
        for p in procs:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text() for log in logs]
    readers = [r for r in (0, 1) if f"damaged shard (rank {r}): " in texts[r]]
    assert len(readers) == 1, "\n".join(t[-3000:] for t in texts)
    cause = readers[0]
    peer = 1 - cause
    assert "'synthetic-000013'" in texts[cause]
    for r in (0, 1):  # what each launcher reports of its rank
        assert "exitcode  : 6" in texts[r], texts[r][-4000:]
    expected = f"rank {peer}: stopped with exit 6 because rank {cause} stopped"
    assert expected in texts[peer], texts[peer][-4000:]
    assert "damaged shard: " in texts[peer] and "'synthetic-000013'" in texts[peer]
    assert "an earlier attempt" not in texts[peer]


@pytest.mark.process
def test_the_watchdog_ends_a_process_stuck_past_the_timeout_and_not_a_paused_one():
    """A process whose main thread is stuck (here: sleeping) after its first micro-batch ends
    with the watchdog's status and message; time spent paused (a checkpoint) does not count."""
    script = (
        "import logging, time\n"
        "from eagle3_train.components.watchdog import StepWatchdog\n"
        "logging.basicConfig()\n"
        "dog = StepWatchdog(1.0, lambda idle: (8, f'stuck for {idle:.1f} s'))\n"
        "dog.start()\n"
        "dog.kick()\n"
        "with dog.paused():\n"
        "    time.sleep(2.5)\n"
        "print('survived the pause', flush=True)\n"
        "time.sleep(30)\n"
    )
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    took = time.monotonic() - started
    assert result.returncode == 8, result.stderr
    assert "survived the pause" in result.stdout and "stuck for" in result.stderr
    assert took < 15
