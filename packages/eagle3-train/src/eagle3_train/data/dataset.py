"""The hidden-state dataset as the trainer sees it (manifest rows, shard layout) and its epoch
plans: packed batches, per-rank shares, held-out samples.

- **Plan** (cheap, no tensor I/O): the samples of a split are shuffled by ``(seed, epoch)``
  and packed greedily, in that order, into batches of at most ``max_tokens`` tokens (a longer
  sample keeps its prefix). Batches are dealt round-robin to ranks after trimming the list
  to a multiple of the world size, so every rank runs the same number of steps and no two
  ranks share a sample.
- **Resume**: the data position is (epoch, batches consumed); the plan is recomputed and
  the consumed batches are skipped without being read.

Reading the planned batches: loader.py.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from eagle3_schemas.io.safetensors_format import NUMPY_VIEWS, read_safetensors
from eagle3_schemas.layouts.hidden_states import (
    PER_TOKEN_TENSORS,
    resolve_shard_path,
)

ROW_COLUMNS = ("sample_id", "row_start", "num_tokens", "num_loss_tokens", "checksum")
PER_TOKEN = ("aux_hidden_states", "last_hidden_state", "input_ids", "loss_mask")
SCALES = ("aux_hidden_states_scale", "last_hidden_state_scale")
# the loader reads exactly the tensors a row checksum covers
assert set(PER_TOKEN + SCALES) == set(PER_TOKEN_TENSORS)
TORCH_VIEWS = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn}

Batch = dict[str, Any]
# One planned batch: (sample index, tokens taken from the start of the sample)
BatchPlan = list[tuple[int, int]]


class CorruptSample(ValueError):
    """A sample's stored rows do not hash to the manifest's checksum (data.on_corrupt: stop)."""


@dataclass(frozen=True)
class ShardTensor:
    dtype: str
    shape: tuple[int, ...]
    offset: int


class HiddenStateDataset:
    """The manifest and shard headers of a hidden-state dataset (no tensor data is read).

    A finished dataset is read whole (``HiddenStateDataset(root)``); a stream's grows shard by
    shard as they are sealed (``empty`` then ``add_shard``). Samples are numbered in the order
    they were added, which is the manifest's order for a finished dataset.
    """

    def __init__(self, root: str | Path) -> None:
        root = Path(root)
        header_file = root / "dataset.json"
        self._start(root, json.loads(header_file.read_text(encoding="utf-8")), header_file)
        table = pq.read_table(
            self.root / "manifest.parquet",
            columns=["shard", *ROW_COLUMNS],
        )
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
        first = 0
        shards = columns["shard"]
        for end in range(1, len(shards) + 1):  # manifest rows of one shard are consecutive
            if end == len(shards) or shards[end] != shards[first]:
                self.add_shard(
                    shards[first],
                    zip(*(columns[c][first:end] for c in ROW_COLUMNS), strict=True),
                )
                first = end

    @classmethod
    def empty(cls, root: Path, header: dict[str, Any], header_file: Path) -> HiddenStateDataset:
        dataset = cls.__new__(cls)
        dataset._start(root, header, header_file)
        return dataset

    def _start(self, root: Path, header: dict[str, Any], header_file: Path) -> None:
        self.root = root
        self.header = header
        self.header_file = header_file  # where messages send the reader
        self.shard_paths: list[Path] = []
        self.shard_tensors: list[dict[str, ShardTensor]] = []
        self.sample_ids: list[str] = []
        # plain lists for the per-sample hot loop (numpy scalars are slow to index)
        self.shard_list: list[int] = []
        self.row_start_list: list[int] = []
        self._lengths: list[int] = []
        self._loss_tokens: list[int] = []
        self.checksum_list: list[str] = []
        self._arrays: dict[str, np.ndarray] = {}
        target = header["target"]
        self.hidden_size: int = int(target["hidden_size"])
        self.vocab_size: int = int(target["vocab_size"])
        self.aux_layer_ids: list[int] = list(header["aux_layer_ids"])
        self.storage_dtype: str = header["storage_dtype"]
        self.schema_version: int = int(header["schema_version"])

    def add_shard(self, shard: str, rows: Iterable[tuple[str, int, int, int, str]]) -> range:
        """Register a shard file and its manifest rows (sample_id, row_start, num_tokens,
        num_loss_tokens, checksum); reads only its safetensors header. Returns the new sample
        indices."""
        path = resolve_shard_path(self.root, shard)
        st = read_safetensors(path)
        index = len(self.shard_paths)
        self.shard_paths.append(path)
        self.shard_tensors.append(
            {n: ShardTensor(t.dtype, t.shape, t.start) for n, t in st.tensors.items()}
        )
        first = len(self.sample_ids)
        for sample_id, row_start, num_tokens, num_loss_tokens, checksum in rows:
            self.sample_ids.append(sample_id)
            self.checksum_list.append(checksum)
            self.shard_list.append(index)
            self.row_start_list.append(int(row_start))
            self._lengths.append(int(num_tokens))
            self._loss_tokens.append(int(num_loss_tokens))
        self._arrays.clear()
        return range(first, len(self.sample_ids))

    def _array(self, name: str, values: list[int], dtype: type) -> np.ndarray:
        if name not in self._arrays:
            self._arrays[name] = np.array(values, dtype=dtype)
        return self._arrays[name]

    @property
    def num_tokens(self) -> np.ndarray:
        return self._array("num_tokens", self._lengths, np.int64)

    @property
    def num_loss_tokens(self) -> np.ndarray:
        return self._array("num_loss_tokens", self._loss_tokens, np.int64)

    @property
    def shard_of(self) -> np.ndarray:
        return self._array("shard_of", self.shard_list, np.int32)

    @property
    def row_start(self) -> np.ndarray:
        return self._array("row_start", self.row_start_list, np.int64)

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    def bytes_per_token(self) -> int:
        first = self.shard_tensors[0]
        total = 0
        for name in PER_TOKEN + SCALES:
            if name in first:
                info = first[name]
                total += (
                    int(np.prod(info.shape[1:], dtype=np.int64)) * NUMPY_VIEWS[info.dtype].itemsize
                )
        return total


def is_validation(sample_id: str, fraction: float) -> bool:
    """Held-out membership from the sample id alone: stable across runs and world sizes.

    The generation events of one conversation (tokenize's ``ID#0``, ``ID#1``, ...) share its
    prompt prefix, so they are held out together: membership is drawn from ``ID``.
    """
    if fraction <= 0:
        return False
    conversation = sample_id.split("#", 1)[0]
    digest = hashlib.blake2b(conversation.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def split_indices(dataset: HiddenStateDataset, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    held = np.array([is_validation(s, fraction) for s in dataset.sample_ids], dtype=bool)
    all_idx = np.arange(len(dataset))
    return all_idx[~held], all_idx[held]


def plan_epoch(
    lengths: np.ndarray,
    indices: np.ndarray,
    max_tokens: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    window: list[int] | None = None,
) -> list[BatchPlan]:
    """Shuffle ``indices`` by (seed, epoch[, *window]) and pack them greedily into
    token-bounded batches."""
    order = np.array(indices, dtype=np.int64)
    if shuffle:
        key = [seed, epoch, *(window or [])]
        order = order[np.random.default_rng(key).permutation(len(order))]
    batches: list[BatchPlan] = []
    current: BatchPlan = []
    used = 0
    for idx in order.tolist():
        n = min(int(lengths[idx]), max_tokens)
        if n < 2:  # a one-token sample has no next token to learn
            continue
        if used + n > max_tokens and current:
            batches.append(current)
            current, used = [], 0
        current.append((idx, n))
        used += n
    if current:
        batches.append(current)
    return batches


def rank_batches(batches: list[BatchPlan], rank: int, world: int) -> list[BatchPlan]:
    """Disjoint per-rank share, equal length on every rank (the remainder is dropped)."""
    usable = len(batches) - len(batches) % world
    return batches[rank:usable:world]
