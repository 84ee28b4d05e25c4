"""Contract pieces of the hidden-state dataset shared by its writer (extract) and readers.

Shard paths are relative and must stay inside the dataset directory; every manifest row
carries a checksum of its stored rows, defined here once per schema version: v1 hashes with
blake2b-128, v2 with XXH3-128 (same bytes, same order; ~20x faster per core, so the writer is
bound by the disk, not the hash). Writers use the newest; readers the dataset's own version.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import xxhash

from eagle3_schemas.io.safetensors_format import SafetensorsFile

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


def _blake2b_128() -> Any:
    return hashlib.blake2b(digest_size=16)


# Checksum algorithm of each schema version: (name written before the hex digest, hasher).
CHECKSUM_ALGORITHMS: dict[int, tuple[str, Callable[[], Any]]] = {
    1: ("blake2b", _blake2b_128),
    2: ("xxh3_128", xxhash.xxh3_128),
}
NEWEST_VERSION = max(CHECKSUM_ALGORITHMS)


def checksum_algorithm(schema_version: int) -> str:
    """The checksum name (prefix) a dataset of ``schema_version`` carries."""
    return CHECKSUM_ALGORITHMS[schema_version][0]


def checksum_rows(
    rows_by_tensor: Mapping[str, bytes | memoryview], schema_version: int = NEWEST_VERSION
) -> str:
    """The version's hash over one sample's raw row bytes of each per-token tensor, in name
    order, as '<algorithm>:<hex>'. Hashers release the GIL on large buffers (threads scale)."""
    name, new_hasher = CHECKSUM_ALGORITHMS[schema_version]
    h = new_hasher()
    for tensor in sorted(n for n in rows_by_tensor if n in PER_TOKEN_TENSORS):
        h.update(rows_by_tensor[tensor])
    return f"{name}:{h.hexdigest()}"


def row_checksum(
    shard: SafetensorsFile, row_start: int, num_tokens: int, schema_version: int = NEWEST_VERSION
) -> str:
    """The checksum of rows [row_start, row_start+num_tokens) as stored in ``shard``."""
    rows = {}
    for name in PER_TOKEN_TENSORS:
        if name in shard.tensors:
            info = shard.tensors[name]
            row_bytes = (info.end - info.start) // max(info.shape[0], 1)
            rows[name] = shard.raw(name)[
                row_start * row_bytes : (row_start + num_tokens) * row_bytes
            ]
    return checksum_rows(rows, schema_version)
