"""Training on a stream while ``eagle3-extract run --stream`` writes it.

The layout and the rules both sides keep are eagle3_schemas.contract.stream's. ``StreamWindows`` is
the shard_window order's source over ``OUT.partial``: a window is read once every shard of
it is sealed (its fragment exists), each shard checked against its fragment first (rows,
size, and with train.validate_inputs every row's checksum), never a torn one. With
data.reclaim the main process writes a receipt for each shard of a window once a checkpoint
covers the window, then deletes the shard; window 0 holds the validation samples and is kept
to the end. Time spent waiting for the producer is counted (``wait_seconds``) and logged.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from eagle3_schemas.contract.stream import (
    CONSUMER_STOPPED,
    FRAGMENTS,
    STREAM_FILE,
    Fragment,
    PlannedShard,
    StreamInfo,
    check_sealed_shard,
    consumed,
    ended,
    partial_dir,
    read_fragment,
    read_stream,
    reclaim,
)
from eagle3_schemas.io.atomic import write_json_atomic
from eagle3_train.data.dataset import HiddenStateDataset

log = logging.getLogger(__name__)

POLL_SECONDS = 0.2


class StreamError(RuntimeError):
    """The stream cannot be trained on as it is (stalled, torn, reclaimed too early)."""


def wait_for_stream(hidden_states: Path, timeout_s: float) -> StreamInfo:
    """The header of the stream of ``hidden_states`` (data.hidden_states names the producer's
    --out; the stream is its work directory), once the producer has written it."""
    root = partial_dir(hidden_states)
    deadline = time.monotonic() + timeout_s
    announced = False
    while not (root / STREAM_FILE).is_file():
        if (hidden_states / "dataset.json").is_file():
            raise StreamError(
                f"data.hidden_states: {hidden_states} is a finished dataset, not a stream "
                f"({root / STREAM_FILE} is absent): train on it with data.stream: false"
            )
        if time.monotonic() > deadline:
            raise StreamError(
                f"{root / STREAM_FILE} did not appear within data.stream_timeout_s={timeout_s} s: "
                "is `eagle3-extract run --stream --out ...` running with the same --out?"
            )
        if not announced:
            log.info("waiting for the producer to open the stream %s", root)
            announced = True
        time.sleep(POLL_SECONDS)
    try:
        return read_stream(root)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StreamError(f"{root / STREAM_FILE}: cannot read the stream header ({e})") from e


class StreamWindows:
    def __init__(
        self,
        info: StreamInfo,
        window_shards: int,
        *,
        deep_check: bool,
        reclaim: bool,
        retain_first: bool,
        timeout_s: float,
    ) -> None:
        self.info = info
        self.root = info.root
        self.dataset = HiddenStateDataset.empty(
            info.root, info.header.to_json(), info.root / STREAM_FILE
        )
        # a stream extracted once per epoch holds one copy of the plan per epoch, in order;
        # windows never straddle two epochs
        per_epoch = len(info.plan) // info.epochs
        self._windows: list[tuple[PlannedShard, ...]] = []
        self._epoch_windows: list[range] = []
        for e in range(info.epochs):
            shards = info.plan[e * per_epoch : (e + 1) * per_epoch]
            start = len(self._windows)
            self._windows += [
                shards[i : i + window_shards] for i in range(0, len(shards), window_shards)
            ]
            self._epoch_windows.append(range(start, len(self._windows)))
        self.deep_check = deep_check
        self.reclaim = reclaim
        self.retain_first = retain_first
        self.timeout_s = timeout_s
        self._fragments: dict[str, Fragment] = {}
        self._opened: dict[int, range] = {}
        self._released: set[int] = set()
        self.wait_seconds = 0.0
        self.freed_bytes = 0

    def windows(self, epoch: int) -> range:
        return self._epoch_windows[epoch if self.info.epochs > 1 else 0]

    def planned_bytes(self, window: int) -> int:
        return sum(self.info.planned_bytes(shard) for shard in self._windows[window])

    def planned_rows(self, window: int) -> tuple[list[str], list[int]]:
        samples = [s for shard in self._windows[window] for s in shard.samples]
        return [i for i, _ in samples], [n for _, n in samples]

    def rows(self, window: int) -> tuple[list[str], list[int]]:
        rows = [r for f in self._sealed(window) for r in f.rows]
        return [r.sample_id for r in rows], [r.num_tokens for r in rows]

    def open(self, window: int) -> range:
        if window in self._opened:
            return self._opened[window]
        first = len(self.dataset)
        for fragment in self._sealed(window):
            if fragment.shard is None:  # every sample rejected by the producer
                continue
            if consumed(self.root, fragment.name) and not (self.root / fragment.shard).exists():
                if (self.root / CONSUMER_STOPPED).is_file():
                    raise StreamError(
                        f"{self.root}: a training run consumed this stream to its end and "
                        f"reclaimed its shards ({self.root / CONSUMER_STOPPED}); nothing is "
                        "left to train on. Its draft is in that run's output_dir/draft"
                    )
                raise StreamError(
                    f"{self.root / fragment.shard} was reclaimed (a receipt under "
                    f"{self.root / '_work/consumed'} says a checkpoint covered it), but this run "
                    f"needs window {window} again: it resumes from a checkpoint older than the "
                    "one that released it. Resume from the latest checkpoint (train.resume: auto)"
                )
            problems = check_sealed_shard(
                self.root, fragment, self.info.header.schema_version, deep=self.deep_check
            )
            if problems:
                raise StreamError(
                    "a sealed shard does not match its fragment:\n" + "\n".join(problems)
                )
            self.dataset.add_shard(
                fragment.shard,
                [
                    (r.sample_id, r.row_start, r.num_tokens, r.num_loss_tokens, r.checksum)
                    for r in fragment.rows
                ],
            )
        self._opened[window] = range(first, len(self.dataset))
        return self._opened[window]

    def release(self, window: int) -> None:
        """Receipts then deletion for the window's shards (main process, data.reclaim)."""
        if not self.reclaim or window in self._released:
            return
        if window == 0 and self.retain_first:
            return  # the validation samples: released by finish()
        for fragment in self._sealed(window):
            receipt: dict[str, Any] = {"window": window, "rows": len(fragment.rows)}
            self.freed_bytes += reclaim(self.root, fragment, receipt)
        self._released.add(window)
        log.info("stream: window %d reclaimed (%d bytes freed so far)", window, self.freed_bytes)

    def finish(self, through: int | None) -> None:
        """Training is over: release the retained window and the windows before ``through``
        (exclusive; None = all), and tell the producer nothing more will be reclaimed."""
        if self.reclaim:
            self.retain_first = False
            for k in range(len(self._windows) if through is None else through):
                if all(read_fragment(self.root, s.name) is not None for s in self._windows[k]):
                    self.release(k)
        write_json_atomic(self.root / CONSUMER_STOPPED, {"freed_bytes": self.freed_bytes})

    def _sealed(self, window: int) -> list[Fragment]:
        return [self._fragment(shard.name) for shard in self._windows[window]]

    def _fragment(self, name: str) -> Fragment:
        if name in self._fragments:
            return self._fragments[name]
        fragment = read_fragment(self.root, name)
        if fragment is None:
            fragment = self._wait_for(name)
        self._fragments[name] = fragment
        return fragment

    def _wait_for(self, name: str) -> Fragment:
        """Block until shard ``name`` is sealed; fail when the producer stalls or ended."""
        started = time.perf_counter()
        log.info("stream: waiting for shard %s (the producer is behind)", name)
        seen = _count(self.root / FRAGMENTS)
        deadline = time.monotonic() + self.timeout_s
        while (fragment := read_fragment(self.root, name)) is None:
            if ended(self.root) and read_fragment(self.root, name) is None:
                raise StreamError(
                    f"{self.root}: the producer ended the stream without sealing planned shard "
                    f"{name} (see {self.root / '_work/end.json'})"
                )
            now_seen = _count(self.root / FRAGMENTS)
            if now_seen != seen:
                seen, deadline = now_seen, time.monotonic() + self.timeout_s
            if time.monotonic() > deadline:
                raise StreamError(
                    f"{self.root}: no shard sealed for data.stream_timeout_s={self.timeout_s} s "
                    f"while waiting for {name}: is the producer still running (or paused on a "
                    "disk budget this run does not reclaim, data.reclaim: false)?"
                )
            time.sleep(POLL_SECONDS)
        waited = time.perf_counter() - started
        self.wait_seconds += waited
        log.info("stream: shard %s sealed after %.1f s of waiting", name, waited)
        return fragment


def _count(directory: Path) -> int:
    try:
        return sum(1 for p in directory.iterdir() if p.suffix == ".json")
    except FileNotFoundError:
        return 0
