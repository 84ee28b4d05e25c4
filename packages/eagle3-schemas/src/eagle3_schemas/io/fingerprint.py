"""The hashing primitives of lineage: canonical JSON and ``"sha256:<hex>"`` fingerprints.

A leaf: it imports nothing of this library, so the contract modules that hash (conversation
ids, remote code, the vocab-map check) and ``lineage`` (which also reads headers) all build on
it without importing each other. Stages import these names from ``eagle3_schemas.contract.lineage``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

PREFIX = "sha256:"


def hex_digest(h: hashlib._Hash) -> str:
    return PREFIX + h.hexdigest()


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode(
        "utf-8"
    )


def fingerprint_json(obj: Any) -> str:
    return hex_digest(hashlib.sha256(canonical_json(obj)))


def fingerprint_text(text: str) -> str:
    return hex_digest(hashlib.sha256(text.encode("utf-8")))


def fingerprint_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return hex_digest(h)


def fingerprint_files(paths: Iterable[Path], root: Path) -> str:
    """Names (relative to ``root``) and contents of several files, order-independent."""
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(fingerprint_file(path).encode() + b"\0")
    return hex_digest(h)


def fingerprint_vocab_map(d2t: np.ndarray, t2d: np.ndarray) -> str:
    """The draft vocabulary mapping: d2t's then t2d's raw little-endian bytes.

    Recomputable from a vocab_map artifact and from an exported checkpoint alike.
    """
    h = hashlib.sha256(np.ascontiguousarray(d2t, dtype="<i8").tobytes())
    h.update(np.ascontiguousarray(t2d, dtype=np.bool_).tobytes())
    return hex_digest(h)
