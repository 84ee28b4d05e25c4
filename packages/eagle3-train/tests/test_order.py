"""The data order (eagle3_train.data.order) on its own.

Streamed and offline runs share this code, so a bug in it passes every streamed-vs-offline
bit-equality: both sides would train the same wrong batches. Here the order is checked
against what it promises, independently of any run: each epoch trains every training sample
exactly once (``window_passes`` times over a retained window) and no validation sample; ranks
share each window's plan disjointly and drop only its tail; a resume at any position, also in
the middle of a window, yields exactly the rest of the uninterrupted epoch; and a real training
resumed from a checkpoint taken in the middle of a window ends on the uninterrupted draft.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3_train.data.dataset import HiddenStateDataset, is_validation
from eagle3_train.data.order import FinishedWindows, GlobalOrder, Packing, WindowOrder

from support.train import make_inputs, write_config

VALIDATION = 0.2
MAX_TOKENS = 100


@dataclass
class FakeDataset:
    """What the order reads of a HiddenStateDataset: ids, token counts, shard of each row."""

    sample_ids: list[str]
    num_tokens: np.ndarray
    shard_list: list[int]

    def __len__(self) -> int:
        return len(self.sample_ids)


def _dataset(samples: int = 90, per_shard: int = 7, seed: int = 0) -> FakeDataset:
    rng = np.random.default_rng(seed)
    return FakeDataset(
        [f"s{i:04d}" for i in range(samples)],
        rng.integers(2, MAX_TOKENS + 1, samples),  # every sample trainable (>= 2 tokens)
        [i // per_shard for i in range(samples)],
    )


@dataclass
class Recorder:
    """A FinishedWindows that records which windows were opened and released."""

    inner: FinishedWindows
    opened: list[int] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    @property
    def dataset(self):
        return self.inner.dataset

    def windows(self, epoch: int) -> range:
        return self.inner.windows(epoch)

    def planned_rows(self, window: int):
        return self.inner.planned_rows(window)

    def rows(self, window: int):
        return self.inner.rows(window)

    def open(self, window: int) -> range:
        self.opened.append(window)
        return self.inner.open(window)

    def release(self, window: int) -> None:
        self.released.append(window)


def _packing(rank: int = 0, world: int = 1, accumulation: int = 1) -> Packing:
    return Packing(VALIDATION, MAX_TOKENS, 7, rank, world, accumulation)


def _order(kind: str, dataset, packing: Packing, passes: int = 1, window_shards: int = 2):
    if kind == "global":
        return GlobalOrder(dataset, packing)
    return WindowOrder(Recorder(FinishedWindows(dataset, window_shards)), packing, passes)


def _samples(segments) -> list[int]:
    return [i for segment in segments for batch in segment.batches for i, _ in batch]


@pytest.mark.parametrize(
    ("kind", "passes"), [("global", 1), ("shard_window", 1), ("shard_window", 2)]
)
def test_each_epoch_trains_every_training_sample_once_and_no_validation_sample(kind, passes):
    dataset = _dataset()
    training = {i for i, s in enumerate(dataset.sample_ids) if not is_validation(s, VALIDATION)}
    assert 0 < len(training) < len(dataset)  # both kinds of sample are present
    order = _order(kind, dataset, _packing(), passes)
    epochs = []
    for epoch in range(3):
        seen = _samples(order.segments(epoch, 0))
        assert Counter(seen) == {i: passes for i in training}, f"epoch {epoch}"
        epochs.append(seen)
        # a batch never holds more tokens than the bound
        for segment in order.segments(epoch, 0):
            for batch in segment.batches:
                assert sum(n for _, n in batch) <= MAX_TOKENS
    assert len({tuple(e) for e in epochs}) == 3  # reshuffled per epoch: no two alike
    assert sum(len(s.batches) for s in order.segments(0, 0)) == order.steps_per_epoch()
    if kind == "shard_window":  # validation: window 0's held-out samples, none trained on
        held = {i for i in order.source.open(0) if i not in training}
        assert set(order.validation_idx.tolist()) == held and held


def test_window_segments_follow_the_shards_in_manifest_order():
    """One segment per window (on its last pass), holding only that window's samples."""
    dataset = _dataset()
    order = _order("shard_window", dataset, _packing(), passes=2)
    source = order.source.inner
    windows = [s.window for s in order.segments(0, 0)]
    assert windows == [None, 0, None, 1, None, 2, None, 3, None, 4, None, 5, None, 6]
    for segment, window in zip(
        order.segments(0, 0), [w for w in range(7) for _ in (0, 1)], strict=True
    ):
        shards = {dataset.shard_list[i] for i in _samples([segment])}
        assert shards <= {2 * window, 2 * window + 1}
        assert set(_samples([segment])) <= set(source.open(window))


@pytest.mark.parametrize(("world", "accumulation"), [(2, 1), (2, 2), (3, 2)])
def test_ranks_share_each_window_plan_disjointly_and_drop_only_its_tail(world, accumulation):
    """Rank r of W trains batches r, r+W, ... of the one-rank plan of the same window, cut to
    the largest multiple of W x accumulation: the same steps on every rank, nothing twice."""
    dataset = _dataset(samples=150)
    alone = _order("shard_window", dataset, _packing())
    ranks = [
        _order("shard_window", dataset, _packing(r, world, accumulation)) for r in range(world)
    ]
    for epoch in range(2):
        plan = list(alone.segments(epoch, 0))
        shares = [list(order.segments(epoch, 0)) for order in ranks]
        assert all(len(share) == len(plan) for share in shares)
        for k, segment in enumerate(plan):
            mine = [share[k] for share in shares]
            assert {s.window for s in mine} == {segment.window}
            lengths = {len(s.batches) for s in mine}
            assert len(lengths) == 1 and lengths.pop() % accumulation == 0  # whole steps
            trained = [s.batches[j] for j in range(len(mine[0].batches)) for s in mine]
            assert trained == segment.batches[: len(trained)]  # the plan's order, none twice
            # what no rank trains is the plan's tail, shorter than one step of every rank
            assert len(segment.batches) - len(trained) < world * accumulation


@pytest.mark.parametrize("passes", [1, 2])
def test_a_resume_at_any_position_yields_the_rest_of_the_uninterrupted_epoch(passes):
    """Also in the middle of a window: the segments from position p are the uninterrupted
    epoch's batches from p on, with the right positions; windows wholly before p are released
    unopened (their shards may go), none after is released early."""
    dataset = _dataset()
    order = _order("shard_window", dataset, _packing(), passes)
    full = list(order.segments(1, 0))
    batches = [b for s in full for b in s.batches]
    ends, position = {}, 0  # window -> position after its last pass
    for s in full:
        position += len(s.batches)
        if s.window is not None:
            ends[s.window] = position
    inside = 0
    for skip in range(len(batches) + 1):
        resumed = _order("shard_window", dataset, _packing(), passes)
        resumed.source.opened.clear()  # the constructor opens window 0 for validation
        segments = list(resumed.segments(1, skip))
        assert [b for s in segments for b in s.batches] == batches[skip:], f"from {skip}"
        position = skip
        for s in segments:
            assert s.start == position
            position += len(s.batches)
        assert segments[-1].last
        done = [w for w, end in ends.items() if end <= skip and w != max(ends)]
        assert resumed.source.released[: len(done)] == done
        assert not set(resumed.source.opened) & set(done)
        inside += skip not in {0, *ends.values()}
    assert inside > len(ends)  # mid-window positions were among those tried


def _losses(run: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r.get("event") == "train"}


def test_a_resume_from_a_checkpoint_in_the_middle_of_a_window_trains_the_same_draft(
    tmp_path, in_process
):
    """Train in shard_window order saving every step; resume a second run from a checkpoint
    whose position lies strictly inside a window (not window 0): the later losses and the
    final draft equal the uninterrupted run's, bit for bit."""
    inputs = make_inputs(
        tmp_path / "inputs", num_samples=48, samples_per_shard=8, min_len=24, max_len=64
    )
    sections = dict(
        data={"order": "shard_window", "window_shards": 2, "max_tokens_per_batch": 96},
        train={"max_steps": None, "epochs": 2, "save_every": 1, "keep_checkpoints": 1000},
    )
    straight = tmp_path / "straight"
    assert in_process(["--config", str(write_config(inputs, straight, **sections))]) == 0

    dataset = HiddenStateDataset(inputs.hidden_states)
    order = WindowOrder(FinishedWindows(dataset, 2), Packing(0.1, 96, 0, 0, 1, 1))
    segments = list(order.segments(0, 0))
    assert len(segments) >= 3
    first, second = segments[0], segments[1]
    assert len(second.batches) >= 3
    mid = second.start + len(second.batches) // 2  # a step inside window 1, epoch 0
    assert first.start + len(first.batches) < mid < second.start + len(second.batches)
    checkpoint = straight / "checkpoints" / f"step-{mid:08d}"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert (state["epoch"], state["batches_done"]) == (0, mid)

    resumed = tmp_path / "resumed"
    sections["train"]["resume"] = str(checkpoint)
    assert in_process(["--config", str(write_config(inputs, resumed, **sections))]) == 0
    expected, got = _losses(straight), _losses(resumed)
    assert min(got) == mid + 1 and max(got) == max(expected)
    assert got == {step: expected[step] for step in got}
    last = f"step-{max(expected):08d}"
    for export in (Path("draft"), Path("exports") / last):  # the best, and the last step's
        final = load_file(str(straight / export / "model.safetensors"))
        draft = load_file(str(resumed / export / "model.safetensors"))
        assert sorted(draft) == sorted(final)
        for key, value in draft.items():
            assert torch.equal(value, final[key]), f"{export}: {key}"
