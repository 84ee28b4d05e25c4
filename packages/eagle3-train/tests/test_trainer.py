"""What users expect of the trainer: run.yaml, metrics, TensorBoard, validation and best
draft selection, and a clear stop on a non-finite loss that keeps the last good checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from eagle3_schemas.contract.header import read_header, write_safetensors
from eagle3_schemas.contract.validate import validate

from support.edits import as_hidden_states_v1, rewrite_checksums
from support.train import make_inputs, write_config


def _records(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_run_leaves_config_metrics_tensorboard_and_the_best_draft(tmp_path, in_process):
    inputs = make_inputs(tmp_path / "inputs", num_samples=40)
    run = tmp_path / "run"
    config = write_config(
        inputs,
        run,
        train={"max_steps": 8, "epochs": 3, "trackers": ["tensorboard"], "save_every": 0},
    )
    assert in_process(["--config", str(config), "--set", "train.log_every=2"]) == 0
    assert "log_every: 2" in (run / "run.yaml").read_text()  # the CLI override is recorded
    records = _records(run)
    train = [r for r in records if r.get("event") == "train"]
    assert [r["step"] for r in train] == [2, 4, 6, 8]
    assert {"loss", "lr", "full_acc_0", "cond_acc_2", "accept_len_proxy", "grad_norm"} <= set(
        train[0]
    )
    vals = [r for r in records if r.get("event") == "validation"]
    assert vals, "no validation ran"
    done = records[-1]
    assert done["event"] == "done"
    assert list(run.rglob("events.out.tfevents.*")), "no TensorBoard event file"
    best = min(vals, key=lambda r: r["val/loss"])
    assert done["best_step"] == best["step"]
    assert validate(run / "draft") == []
    exported = json.loads((run / "draft" / "eagle3.json").read_text())
    assert exported["training"]["steps"] == best["step"]
    assert exported["lineage"]["vocab_map_fingerprint"].startswith("sha256:")


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, in_process, caplog):
    inputs = make_inputs(tmp_path / "inputs", num_samples=48, samples_per_shard=8)
    # poison one shard (validation would refuse it; the run skips preflight to get there)
    shard = sorted((inputs.hidden_states / "shards").glob("*.safetensors"))[-1]
    tensors = load_file(str(shard))
    tensors["last_hidden_state"][:] = float("inf")
    write_safetensors(shard, tensors)
    rewrite_checksums(inputs.hidden_states)  # as the target produced them: checksums agree
    run = tmp_path / "run"
    config = write_config(
        inputs,
        run,
        data={"validation_fraction": 0.0},
        train={"max_steps": 40, "epochs": 4, "save_every": 1},
    )
    with caplog.at_level(logging.ERROR, logger="eagle3_train"):
        assert in_process(["--config", str(config), "--no-preflight"]) == 3
    nan = [r for r in _records(run) if r.get("event") == "nan"]
    assert len(nan) == 1
    message = nan[0]["message"]
    assert "loss is not finite" in message and "last good checkpoint" in message
    assert any("not finite" in r.getMessage() for r in caplog.records)
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())["step"]
    assert latest == nan[0]["step"] - 1  # nothing saved from the failing step on
    assert not (run / "draft").exists()


def test_a_v1_hidden_state_dataset_still_trains_and_trains_alike(tmp_path, in_process):
    """hidden_states v2 changed only the row checksum: a dataset written as v1 passes the
    preflight (which validates it with v1's blake2b rule) and trains to the same losses."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=24)
    v1 = tmp_path / "hidden_states_v1"
    shutil.copytree(inputs.hidden_states, v1)
    as_hidden_states_v1(v1)
    losses = {}
    for name, dataset in (("v2", inputs.hidden_states), ("v1", v1)):
        run = tmp_path / name
        config = write_config(
            dataclasses.replace(inputs, hidden_states=dataset),
            run,
            train={"max_steps": 3, "save_every": 0},
        )
        assert in_process(["--config", str(config)]) == 0
        AcceleratorState._reset_state(reset_partial_state=True)
        losses[name] = [r["loss"] for r in _records(run) if r.get("event") == "train"]
        assert validate(run / "draft") == []
    assert read_header(v1).schema_version == 1
    assert len(losses["v1"]) == 3 and losses["v1"] == losses["v2"]


@pytest.mark.slow
def test_the_cuda_configuration_rehearsed_on_cpu_trains_resumes_and_exports(tmp_path, in_process):
    """What eagle3-train runs on CUDA — bf16 autocast, bf16 frozen target weights, the flash
    attention, compiled layers and loss — here on CPU's kernels: preflight's flash check,
    checkpoints, a launch resumed from the middle checkpoint that continues the same loss
    series, the export."""
    from eagle3_train.model.draft import compile_target_distribution
    from eagle3_train.model.flash_attention import compile_flash_attention
    from eagle3_train.model.loss import compile_kl_chunk

    inputs = make_inputs(tmp_path / "inputs", num_samples=40)
    draft = {"attention": "flash"}
    train = {"mixed_precision": "bf16", "compile": "always", "epochs": 3, "log_every": 1}
    train.update(max_steps=6, save_every=3)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    try:
        config = write_config(inputs, straight, draft=draft, train=train)
        assert in_process(["--config", str(config)]) == 0
        middle = straight / "checkpoints" / f"step-{3:08d}"
        config = write_config(inputs, resumed, draft=draft, train={**train, "resume": str(middle)})
        assert in_process(["--config", str(config)]) == 0
    finally:
        compile_kl_chunk(False)
        compile_flash_attention(False)
        compile_target_distribution(False)
    losses = {
        run: {r["step"]: r["loss"] for r in _records(run) if r.get("event") == "train"}
        for run in (straight, resumed)
    }
    assert sorted(losses[straight]) == list(range(1, 7))
    assert losses[resumed] == {s: losses[straight][s] for s in (4, 5, 6)}
    (start,) = [r for r in _records(resumed) if r.get("event") == "start"]
    assert start["step"] == 3
    assert not validate(resumed / "draft")
