"""The schema files under ``schemas/``: which artifact kinds and versions exist, and loading one.

Checking the files themselves and freezing released versions is ``meta_check``'s.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schema_files"
META = "meta"


@functools.cache
def _load(relpath: str) -> dict[str, Any]:
    return json.loads((SCHEMA_DIR / relpath).read_text(encoding="utf-8"))


def artifact_kinds() -> list[str]:
    return sorted(p.name for p in SCHEMA_DIR.iterdir() if p.is_dir() and p.name != META)


def versions(artifact: str) -> list[int]:
    found = [
        int(m.group(1))
        for p in (SCHEMA_DIR / artifact).glob("v*.json")
        if (m := re.fullmatch(r"v(\d+)\.json", p.name))
    ]
    return sorted(found)


def load_schema(artifact: str, version: int | None = None) -> dict[str, Any]:
    """The schema of ``artifact`` at ``version`` (newest when None)."""
    known = versions(artifact) if (SCHEMA_DIR / artifact).is_dir() else []
    if not known:
        raise KeyError(f"unknown artifact kind {artifact!r}; known kinds: {artifact_kinds()}")
    version = known[-1] if version is None else version
    if version not in known:
        raise KeyError(f"{artifact}: schema version {version} does not exist (known: {known})")
    return _load(f"{artifact}/v{version}.json")
