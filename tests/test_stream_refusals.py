"""Every refusal of the streaming hand-off, one fast test per message and exit code, on small
synthetic streams (tests/support/synthetic_stream.py: a finished synthetic dataset laid out as a
stream, no extraction): the stream config refusals of both stages (exit 2), train preflight's
stream check (the deadlocks it refuses, exit 2; the wait it warns of), and a stream that fails
during training (exit 4: the producer ended or stalled, a shard reclaimed too early); a stream
consumed to its end is refused before the first step. The streamed runs with real producers
are in test_stream.py."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3_extract.cli import main as extract_main
from eagle3_schemas.contract.stream import (
    CONSUMER_STOPPED,
    FRAGMENTS,
    partial_dir,
    read_fragment,
    read_stream,
    reclaim,
)

from support.stage_cli import Outcome, run_cli, run_train_cli
from support.synthetic_stream import seal_rest, stream_of
from support.train import REPO, Inputs, make_inputs, write_config

EXIT_CONFIG = EXIT_PREFLIGHT = 2
EXIT_STREAM = 4
WINDOW_SHARDS = 2
DELAY = 1.5  # seconds a producer keeps the trainer waiting


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    """40 synthetic samples in 5 shards: windows of 2 shards -> 3 windows."""
    return make_inputs(
        tmp_path_factory.mktemp("synthetic"), num_samples=40, samples_per_shard=8, max_len=48
    )


def _config(inputs: Inputs, tmp: Path, out: Path, *, train: dict | None = None, **data) -> Path:
    return write_config(
        inputs,
        tmp / "run",
        data={
            "hidden_states": str(out),
            "order": "shard_window",
            "window_shards": WINDOW_SHARDS,
            "validation_fraction": 0.3,  # window 0 holds validation samples
            "stream": True,
            "stream_timeout_s": 60,
            **data,
        },
        train={"max_steps": None, "epochs": 1, "save_every": 1000, **(train or {})},
    )


def _train(config: Path, *args: str) -> Outcome:
    return run_train_cli(["--config", str(config), *args])


def _window_bytes(stream: Path) -> list[int]:
    """Planned bytes per window, as train preflight computes them."""
    info = read_stream(stream)
    shards = [info.planned_bytes(s) for s in info.plan]
    return [sum(shards[i : i + WINDOW_SHARDS]) for i in range(0, len(shards), WINDOW_SHARDS)]


def _rounding(done: dict) -> float:
    """What the done record's rounding (seconds to 3 decimals, the share to 4) allows between
    its idle share and wait_s / seconds recomputed from the rounded values."""
    wait, seconds = done["stream_wait_s"], done["seconds"]
    return 5e-4 / seconds * (1 + wait / seconds) + 5e-5


# ---- the synthetic stream is a stream ------------------------------------------------------


def test_a_synthetic_stream_trains_the_draft_of_its_finished_dataset(inputs, tmp_path):
    """The basis of the refusals below: the made-up stream is sound, and trains (with
    reclaim) exactly the finished dataset's draft in the same order."""
    out = tmp_path / "hs"
    stream = stream_of(inputs.hidden_states, out)
    streamed = _config(inputs, tmp_path, out)
    result = _train(streamed, "--reclaim")
    assert result.code == 0, result.log[-3000:]
    offline = write_config(
        inputs,
        tmp_path / "offline",
        **{k: v for k, v in yaml.safe_load(streamed.read_text()).items() if k in ("data", "train")},
    )
    loaded = yaml.safe_load(offline.read_text())
    loaded["data"].update(hidden_states=str(inputs.hidden_states), stream=False)
    offline.write_text(yaml.safe_dump(loaded))
    result = _train(offline)
    assert result.code == 0, result.log[-3000:]
    a = load_file(str(tmp_path / "run" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "offline" / "draft" / "model.safetensors"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((stream / "shards").iterdir())  # every shard reclaimed at the end
    assert (stream / CONSUMER_STOPPED).is_file()


# ---- config refusals: eagle3-train ---------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"order": "global"},
            "data.stream: a stream is read window by window; set data.order: shard_window "
            "(found 'global')",
        ),
        ({"stream": False, "reclaim": True}, "data.reclaim: deletes shards of a stream only"),
        ({"window_passes": 0}, "data.window_passes: 0 < 1"),
        (
            {"stream": False, "order": "global", "window_passes": 2},
            "data.window_passes: passes over a window need data.order: shard_window",
        ),
        ({"stream_timeout_s": 0}, "data.stream_timeout_s: 0.0 must be > 0"),
    ],
)
def test_train_refuses_a_stream_config(inputs, tmp_path, data: dict, message: str):
    result = _train(_config(inputs, tmp_path, tmp_path / "never", **data))
    assert result.code == EXIT_CONFIG, result.log[-3000:]
    assert "config error" in result.log and message in result.log, result.log[-3000:]
    assert not (tmp_path / "run").exists()


# ---- config refusals: eagle3-extract -------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--disk-budget", "1GB"], "disk_budget bounds a stream: set stream too"),
        (["--epochs", "2"], "stream_epochs 2: re-extraction per epoch is for a stream"),
        (
            ["--stream", "--rank", "0", "--world-size", "2"],
            "stream: one producer per stream (world_size 1",
        ),
    ],
)
def test_extract_refuses_a_stream_config(tmp_path, args: list[str], message: str):
    out = tmp_path / "hs"
    argv = ["run", "--model", str(REPO / "recipes" / "tiny" / "target"), "--out", str(out)]
    argv += ["--tokenized", str(tmp_path / "absent.parquet"), *args]
    result = run_cli(extract_main, argv)
    assert result.code == EXIT_CONFIG, result.log[-3000:]
    assert message in result.log, result.log[-3000:]
    assert not out.exists() and not partial_dir(out).exists()


# ---- train preflight's stream check --------------------------------------------------------


def _preflight(inputs: Inputs, tmp: Path, stream_kwargs: dict, **config: Any) -> Outcome:
    out = tmp / "hs"
    stream_of(inputs.hidden_states, out, **stream_kwargs)
    return _train(_config(inputs, tmp, out, **config), "--preflight")


def test_preflight_refuses_a_stream_extracted_for_other_epochs(inputs, tmp_path):
    result = _preflight(inputs, tmp_path, {"epochs": 2})
    assert result.code == EXIT_PREFLIGHT, result.log[-3000:]
    assert (
        "the stream is extracted once for each of 2 epochs (eagle3-extract --epochs) but "
        "train.epochs is 1" in result.log
    )


def test_preflight_refuses_reclaiming_shards_a_later_epoch_needs(inputs, tmp_path):
    result = _preflight(inputs, tmp_path, {}, reclaim=True, train={"epochs": 2})
    assert result.code == EXIT_PREFLIGHT, result.log[-3000:]
    assert "data.reclaim with train.epochs=2: epoch 2 needs shards epoch 1 reclaimed" in result.log


def test_preflight_refuses_a_budget_below_the_stream_without_reclaim(inputs, tmp_path):
    probe = stream_of(inputs.hidden_states, tmp_path / "probe")
    total = sum(_window_bytes(probe))
    result = _preflight(inputs, tmp_path, {"budget": total - 1})
    assert result.code == EXIT_PREFLIGHT, result.log[-3000:]
    assert (
        f"the stream's --disk-budget ({total - 1} bytes) is smaller than the whole stream "
        f"({total} bytes planned) and data.reclaim is off: the producer would pause forever"
        in result.log
    )


def test_preflight_refuses_a_budget_where_producer_and_trainer_wait_for_each_other(
    inputs, tmp_path
):
    windows = _window_bytes(stream_of(inputs.hidden_states, tmp_path / "probe"))
    budget = windows[0] + max(windows) - 1
    result = _preflight(inputs, tmp_path, {"budget": budget}, reclaim=True)
    assert result.code == EXIT_PREFLIGHT, result.log[-3000:]
    assert (
        f"the stream's --disk-budget ({budget} bytes) cannot hold window 0 (kept for "
        f"validation, {windows[0]} bytes) and the largest window ({max(windows)} bytes, "
        "data.window_shards=2) at once: producer and trainer would wait for each other"
        in result.log
    )


@pytest.mark.parametrize("room", ["one window", "two windows"])
def test_preflight_passes_a_budget_for_window_0_and_one_window_with_a_warning(
    inputs, tmp_path, room: str
):
    windows = _window_bytes(stream_of(inputs.hidden_states, tmp_path / "probe"))
    budget = windows[0] + (1 if room == "one window" else 2) * max(windows)
    result = _preflight(inputs, tmp_path, {"budget": budget}, reclaim=True)
    assert result.code == 0, result.log[-3000:]
    warning = (
        f"the stream's --disk-budget ({budget} bytes) holds window 0 and one window "
        f"({windows[0] + max(windows)} bytes) but not the next one as well: the trainer waits "
        "for the producer at every window"
    )
    ok = "holds window 0, the window in training and the next one"
    assert (warning in result.log) == (room == "one window"), result.log[-3000:]
    assert (ok in result.log) == (room == "two windows"), result.log[-3000:]


# ---- a stream that fails while training: exit 4, the last checkpoint stands -------------


def _fails(config: Path, message: str, *args: str) -> Outcome:
    result = _train(config, *args)
    assert result.code == EXIT_STREAM, result.log[-3000:]
    assert message in result.log, result.log[-3000:]
    return result


def test_a_producer_that_ended_without_sealing_a_planned_shard_stops_training(inputs, tmp_path):
    out = tmp_path / "hs"
    stream = stream_of(inputs.hidden_states, out, sealed=3, end=True)
    _fails(
        _config(inputs, tmp_path, out),
        f"{stream}: the producer ended the stream without sealing planned shard e0-shard-00003",
    )


def test_a_producer_that_stalled_stops_training_after_the_timeout(inputs, tmp_path):
    out = tmp_path / "hs"
    stream = stream_of(inputs.hidden_states, out, sealed=3, end=False)
    _fails(
        _config(inputs, tmp_path, out, stream_timeout_s=1),
        f"{stream}: no shard sealed for data.stream_timeout_s=1.0 s while waiting for "
        "e0-shard-00003",
    )


def test_a_shard_reclaimed_before_this_run_trained_it_stops_training(inputs, tmp_path):
    """A receipt for a window this run has not checkpointed (it resumes from an older
    checkpoint, here none): the shard is gone, so the run stops rather than skip it."""
    out = tmp_path / "hs"
    stream = stream_of(inputs.hidden_states, out)
    fragment = read_fragment(stream, "e0-shard-00002")  # window 1
    assert fragment is not None and reclaim(stream, fragment, {"window": 1}) > 0
    _fails(
        _config(inputs, tmp_path, out),
        f"{stream / fragment.shard} was reclaimed (a receipt under "
        f"{stream / '_work/consumed'} says a checkpoint covered it), but this run needs window "
        "1 again: it resumes from a checkpoint older than the one that released it",
    )
    assert not (tmp_path / "run" / "draft").exists()


def test_a_stream_consumed_to_its_end_is_not_trained_again(inputs, tmp_path):
    """Window 0 (validation) is opened before training, so this one is refused at once."""
    out = tmp_path / "hs"
    stream = stream_of(inputs.hidden_states, out)
    config = _config(inputs, tmp_path, out)
    assert _train(config, "--reclaim").code == 0
    assert (stream / CONSUMER_STOPPED).is_file() and not list((stream / "shards").iterdir())
    (tmp_path / "again").mkdir()
    again = _config(inputs, tmp_path / "again", out)
    result = _train(again)
    assert result.code == EXIT_PREFLIGHT, result.log[-3000:]  # refused before the first step
    assert "preflight failed" in result.log
    assert (
        f"{stream}: a training run consumed this stream to its end and reclaimed its shards"
        in result.log
    ), result.log[-3000:]


def test_fragments_count_sealed_shards(inputs, tmp_path):
    """The helper seals what it is told to: fragments of the first shards only."""
    stream = stream_of(inputs.hidden_states, tmp_path / "hs", sealed=2, end=False)
    assert sorted(p.stem for p in (stream / FRAGMENTS).iterdir()) == [
        "e0-shard-00000",
        "e0-shard-00001",
    ]
    info = json.loads((stream / "_work/stream.json").read_text())
    assert len(info["stream"]["plan"]) == 5 and math.isfinite(info["stream"]["bytes_per_token"])


# ---- what a streamed run reports ------------------------------------------------------------


def test_the_trainer_reports_the_time_it_waited_for_the_producer(inputs, tmp_path):
    """A producer that seals window 1 only a while after training began: the trainer's wait
    shows in its per-log stream_wait_s, in the run's total, and as the idle share of its
    time (the bound 0 <= share <= 1 alone could not fail)."""
    import threading

    out = tmp_path / "hs"
    stream = stream_of(inputs.hidden_states, out, sealed=2, end=False)  # window 0 only
    metrics = tmp_path / "run" / "metrics.jsonl"

    def producer() -> None:
        deadline = time.monotonic() + 120
        while '"event": "train"' not in (metrics.read_text() if metrics.is_file() else ""):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        time.sleep(DELAY)
        seal_rest(stream, inputs.hidden_states)

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    result = _train(_config(inputs, tmp_path, out))
    thread.join()
    assert result.code == 0, result.log[-3000:]
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    done = records[-1]
    assert done["event"] == "done"
    assert DELAY / 2 <= done["stream_wait_s"] <= done["seconds"]
    assert done["stream_idle_fraction"] == pytest.approx(
        done["stream_wait_s"] / done["seconds"], abs=_rounding(done)
    )
    logged = [r["stream_wait_s"] for r in records if r.get("event") == "train"]
    assert DELAY / 2 <= sum(logged) <= done["stream_wait_s"] + 1e-3
    assert max(logged) >= DELAY / 2  # the wait shows at the step after it, not spread out


# ---- the producer's disk gate ----------------------------------------------------------------


def _gate(tmp_path: Path, on_disk: int):
    """A producer's gate over a stream holding ``on_disk`` bytes of shards, and a group of
    work that fits the budget only once those bytes are reclaimed."""
    import numpy as np

    from eagle3_extract.plan import ShardPlan
    from eagle3_extract.samples import Sample
    from eagle3_extract.streaming import DiskGate, planned_bytes

    root = tmp_path / "hs.partial"
    (root / "shards").mkdir(parents=True)
    (root / "shards" / "old.safetensors").write_bytes(b"\0" * on_disk)
    ids = np.zeros(10, dtype=np.int32)
    group = [ShardPlan("next", (Sample(0, "s0", ids, ids.astype(np.uint8)),))]
    need = planned_bytes(group, per_token=100)
    return root, DiskGate(root, need + on_disk // 2, 100, poll_seconds=0.02), group


def test_a_producer_paused_on_its_budget_goes_on_once_the_trainer_reclaims(tmp_path):
    import threading

    root, gate, group = _gate(tmp_path, 5000)
    timer = threading.Timer(0.3, (root / "shards" / "old.safetensors").unlink)
    timer.start()
    gate.wait_for_room(group)
    timer.join()
    assert gate.paused_seconds >= 0.2


def test_a_producer_paused_on_its_budget_stops_when_the_trainer_has_stopped(tmp_path):
    """Nothing will reclaim: the producer stops (eagle3-extract run: exit 1) instead of
    pausing forever."""
    from eagle3_extract.streaming import DiskBudgetError

    root, gate, group = _gate(tmp_path, 5000)
    (root / CONSUMER_STOPPED).parent.mkdir(parents=True)
    (root / CONSUMER_STOPPED).write_text("{}")
    with pytest.raises(DiskBudgetError) as refused:
        gate.wait_for_room(group)
    assert (
        f"the trainer reading {root} has stopped ({root / CONSUMER_STOPPED}) and reclaims "
        "nothing more; next and later shards do not fit the budget" in str(refused.value)
    )
