"""Tokenized samples (schema ``tokenized`` v1) as the extract stage reads them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_schemas.contract.header import Header, read_header
from eagle3_schemas.layouts.conversations import select_rows


@dataclass(frozen=True)
class Sample:
    """One tokenized sample; ``index`` is its row in the tokenized file."""

    index: int
    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class Tokenized:
    path: Path
    header: Header
    samples: list[Sample]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


def read_tokenized(
    path: Path, max_samples: int | None = None, sample_seed: int | None = None
) -> Tokenized:
    """Read the rows of a tokenized Parquet file that ``select_rows`` picks."""
    header = read_header(path)
    if header.artifact != "tokenized":
        raise ValueError(f"{path}: is a {header.artifact!r} artifact, expected 'tokenized'")
    table = pq.read_table(path, columns=["id", "input_ids", "loss_mask"])
    rows = select_rows(table.column("id").to_pylist(), max_samples, sample_seed)
    if sample_seed is None:
        table = table.slice(0, len(rows))  # the first rows: no copy
    else:
        table = table.take(pa.array(rows, pa.int64()))
    ids = table.column("id").to_pylist()
    input_ids = table.column("input_ids").combine_chunks()
    loss_mask = table.column("loss_mask").combine_chunks()
    # Flat buffers and offsets: one numpy view per sample without a Python list per token.
    flat_ids = input_ids.values.to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
    flat_mask = loss_mask.values.to_numpy(zero_copy_only=False).astype(np.uint8, copy=False)
    id_offsets = input_ids.offsets.to_numpy()
    mask_offsets = loss_mask.offsets.to_numpy()
    samples = []
    for i, sample_id in enumerate(ids):
        a, b = int(id_offsets[i]), int(id_offsets[i + 1])
        c, d = int(mask_offsets[i]), int(mask_offsets[i + 1])
        if b - a != d - c:
            raise ValueError(
                f"{path}: row {rows[i]} (id {sample_id!r}): input_ids has {b - a} tokens but "
                f"loss_mask has {d - c}"
            )
        samples.append(Sample(rows[i], sample_id, flat_ids[a:b], flat_mask[c:d]))
    return Tokenized(path, header, samples)
