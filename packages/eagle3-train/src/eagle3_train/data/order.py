"""The data order: which batches each rank trains on in an epoch, as segments it can read now.

- ``global`` (data.order): every training sample of the dataset shuffled by (seed, epoch),
  packed into batches, dealt round-robin to ranks; one segment per epoch.
- ``shard_window``: the shards, in the extraction's order, cut into windows of
  ``data.window_shards``; each window's training samples shuffled by (seed, epoch, window),
  packed and dealt on their own, trimmed so every rank runs the same whole number of optimizer
  steps per window; one segment per window. Only one window must be on disk at a time, which
  is what a stream needs; a finished dataset trained in this order gets the same batches, so
  a streamed run and an offline one train the same draft. Validation uses the held-out
  samples of window 0, which a reclaiming stream keeps to the end.

Positions are counted in batches of this rank's epoch (TrainerState.batches_done), whatever
the order, so resume skips whole windows without opening them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eagle3_train.data.dataset import (
    BatchPlan,
    HiddenStateDataset,
    is_validation,
    plan_epoch,
    rank_batches,
    split_indices,
)


@dataclass
class Segment:
    batches: list[BatchPlan]  # this rank's, in dataset sample indices
    start: int  # position of batches[0] in this rank's epoch
    last: bool  # the epoch's last segment
    window: int | None  # shard window (shard_window order)


@dataclass(frozen=True)
class Packing:
    validation_fraction: float
    max_tokens: int
    seed: int
    rank: int
    world: int
    accumulation: int

    def share(self, batches: list[BatchPlan]) -> list[BatchPlan]:
        """This rank's batches, a whole number of optimizer steps on every rank."""
        mine = rank_batches(batches, self.rank, self.world)
        return mine[: len(mine) - len(mine) % self.accumulation]


class GlobalOrder:
    def __init__(self, dataset: HiddenStateDataset, packing: Packing) -> None:
        self.dataset = dataset
        self.packing = packing
        self.train_idx, self.validation_idx = split_indices(dataset, packing.validation_fraction)

    def epoch_batches(self, epoch: int) -> list[BatchPlan]:
        p = self.packing
        batches = plan_epoch(self.dataset.num_tokens, self.train_idx, p.max_tokens, p.seed, epoch)
        return p.share(batches)

    def steps_per_epoch(self) -> int:
        return len(self.epoch_batches(0)) // self.packing.accumulation

    def segments(self, epoch: int, skip: int) -> Iterator[Segment]:
        batches = self.epoch_batches(epoch)
        yield Segment(batches[skip:], skip, True, None)


class WindowSource(Protocol):
    """Where shard windows come from: a finished dataset, or a stream (eagle3_train.data.stream)."""

    dataset: HiddenStateDataset

    def windows(self, epoch: int) -> range:
        """The windows epoch ``epoch`` trains on, in order (a stream extracted once per epoch
        has its own shards for each; otherwise every epoch reads the same ones)."""
        ...

    def planned_rows(self, window: int) -> tuple[list[str], list[int]]:
        """(sample ids, token counts) the window is expected to hold, without waiting."""
        ...

    def rows(self, window: int) -> tuple[list[str], list[int]]:
        """(sample ids, token counts) the window holds; waits until it is sealed."""
        ...

    def open(self, window: int) -> range:
        """Register the window's shards for reading; its dataset sample indices."""
        ...

    def release(self, window: int) -> None:
        """A checkpoint covers every batch of the window: its shards may go."""
        ...


class FinishedWindows:
    """Windows of a finished dataset: its shards, in manifest order."""

    def __init__(self, dataset: HiddenStateDataset, window_shards: int) -> None:
        self.dataset = dataset
        shards = np.asarray(dataset.shard_list, dtype=np.int64)
        bounds = [0, *np.flatnonzero(np.diff(shards)) + 1, len(shards)]  # sample ranges by shard
        per_shard = [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]
        self._windows = [
            range(group[0].start, group[-1].stop)
            for group in (
                per_shard[i : i + window_shards] for i in range(0, len(per_shard), window_shards)
            )
        ]

    def windows(self, epoch: int) -> range:
        return range(len(self._windows))

    def rows(self, window: int) -> tuple[list[str], list[int]]:
        r = self._windows[window]
        return self.dataset.sample_ids[r.start : r.stop], self.dataset.num_tokens[
            r.start : r.stop
        ].tolist()

    planned_rows = rows

    def open(self, window: int) -> range:
        return self._windows[window]

    def release(self, window: int) -> None:
        return None


class WindowOrder:
    """shard_window order; ``passes`` > 1 trains each window that many times (each pass
    shuffled anew) before the next: the retained-window way to several epochs."""

    def __init__(self, source: WindowSource, packing: Packing, passes: int = 1) -> None:
        self.source = source
        self.packing = packing
        self.passes = passes
        self.dataset = source.dataset
        first = source.windows(0)
        validation = source.open(first.start) if len(first) else range(0)
        self.validation_idx = np.array(
            [
                i
                for i in validation
                if is_validation(self.dataset.sample_ids[i], packing.validation_fraction)
            ],
            dtype=np.int64,
        )

    def _window_batches(
        self, epoch: int, key: list[int], ids: Sequence[str], lengths: Sequence[int]
    ) -> list[BatchPlan]:
        """This rank's batches of one window pass, in window-local sample indices."""
        p = self.packing
        train = [i for i, s in enumerate(ids) if not is_validation(s, p.validation_fraction)]
        batches = plan_epoch(
            np.asarray(lengths, dtype=np.int64), train, p.max_tokens, p.seed, epoch, window=key
        )
        return p.share(batches)

    def _key(self, window: int, epoch: int, pass_: int) -> list[int]:
        """The shuffle key: the window's place in its epoch (the same for a stream extracted
        once per epoch as for the finished dataset), and the pass when there are several."""
        local = window - self.source.windows(epoch).start
        return [local] if self.passes == 1 else [local, pass_]

    def steps_per_epoch(self) -> int:
        """From the planned rows (a stream's plan; exact unless the producer rejects samples)."""
        batches = sum(
            len(self._window_batches(0, self._key(k, 0, q), *self.source.planned_rows(k)))
            for k in self.source.windows(0)
            for q in range(self.passes)
        )
        return batches // self.packing.accumulation

    def segments(self, epoch: int, skip: int) -> Iterator[Segment]:
        """One segment per window pass; ``window`` is set on a window's last pass only (after
        it, the window's shards may be released)."""
        position = 0
        windows = self.source.windows(epoch)
        for k in windows:
            rows = self.source.rows(k)
            for q in range(self.passes):
                last_pass = q == self.passes - 1
                last = k == windows[-1] and last_pass
                local = self._window_batches(epoch, self._key(k, epoch, q), *rows)
                end = position + len(local)
                if end <= skip and not last:  # trained on before the checkpoint resumed from
                    if last_pass:
                        self.source.release(k)
                    position = end
                    continue
                base = self.source.open(k).start
                first = min(max(skip - position, 0), len(local))
                batches = [[(base + i, n) for i, n in batch] for batch in local[first:]]
                yield Segment(batches, position + first, last, k if last_pass else None)
                position = end
