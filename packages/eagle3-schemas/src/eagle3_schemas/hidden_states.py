"""Contract pieces of the hidden-state dataset shared by its writer (extract) and readers.

Shard paths are relative and must stay inside the dataset directory; every manifest row
carries a checksum of its stored rows, defined here once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path, PurePosixPath

from eagle3_schemas.safetensors_format import SafetensorsFile

SHARD_DIR = "shards"
# Tensors whose dim 0 is the token axis (sum_T); the checksum covers these.
PER_TOKEN_TENSORS = (
    "aux_hidden_states",
    "aux_hidden_states_scale",
    "input_ids",
    "last_hidden_state",
    "last_hidden_state_scale",
    "loss_mask",
)


class UnsafeShardPath(ValueError):
    """A manifest shard path that would leave the dataset directory."""


def resolve_shard_path(dataset_dir: Path, shard: str) -> Path:
    """The file a manifest ``shard`` entry names, refusing anything outside ``dataset_dir``."""
    pure = PurePosixPath(shard)
    if pure.is_absolute() or "\\" in shard or ".." in pure.parts or not pure.parts:
        raise UnsafeShardPath(
            f"shard path {shard!r} must be relative, without '..' (convention: shards/<name>.safetensors)"
        )
    if pure.parts[0] != SHARD_DIR:
        raise UnsafeShardPath(f"shard path {shard!r} must lie under {SHARD_DIR}/")
    root = dataset_dir.resolve()
    resolved = (dataset_dir / pure).resolve()
    if not resolved.is_relative_to(root):
        raise UnsafeShardPath(
            f"shard path {shard!r} resolves to {resolved}, outside the dataset directory {root} (symlink?)"
        )
    return resolved


def checksum_rows(rows_by_tensor: Mapping[str, bytes | memoryview]) -> str:
    """blake2b-128 over one sample's raw row bytes of each per-token tensor, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(n for n in rows_by_tensor if n in PER_TOKEN_TENSORS):
        h.update(rows_by_tensor[name])
    return "blake2b:" + h.hexdigest()


def row_checksum(shard: SafetensorsFile, row_start: int, num_tokens: int) -> str:
    """The checksum of rows [row_start, row_start+num_tokens) as stored in ``shard``."""
    rows = {}
    for name in PER_TOKEN_TENSORS:
        if name in shard.tensors:
            info = shard.tensors[name]
            row_bytes = (info.end - info.start) // max(info.shape[0], 1)
            rows[name] = shard.raw(name)[
                row_start * row_bytes : (row_start + num_tokens) * row_bytes
            ]
    return checksum_rows(rows)
