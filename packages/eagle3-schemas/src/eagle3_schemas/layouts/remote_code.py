"""Custom Python code in a model or tokenizer directory: found, named, and run only when trusted.

Targets such as Kimi-K2.5 ship their tokenizer (and model) as Python files that transformers
and vLLM import when ``trust_remote_code`` is set: the ``auto_map`` entries of ``config.json``
and ``tokenizer_config.json`` name them (``"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
null]`` runs ``tokenization_kimi.py``). Every stage that loads a directory asks here first, so
without ``--trust-remote-code`` it stops before any work with a message naming the file that
would run; with it, the files run and the choice is recorded in the artifact's lineage
(``remote_code_record``), so a dataset says which code produced its tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_schemas.io.fingerprint import fingerprint_files

StrPath = str | os.PathLike[str]
# The files whose auto_map entries transformers and vLLM follow, and the loaders each serves.
AUTO_MAP_FILES = {"tokenizer": ("tokenizer_config.json",), "model": ("config.json",)}
TRUST_FLAG = "--trust-remote-code"


class RemoteCodeRefused(ValueError):
    """A directory needs its custom code to load and the user has not trusted it."""


@dataclass(frozen=True)
class RemoteCode:
    """One ``auto_map`` entry: ``loader`` (e.g. AutoTokenizer) → ``reference`` in ``file``."""

    declared_in: Path  # the JSON file holding the auto_map
    loader: str
    reference: str  # "module.Class"
    file: Path  # the Python file that would be imported

    def describe(self) -> str:
        state = "" if self.file.is_file() else " (missing)"
        return (
            f"{self.declared_in} maps {self.loader} to {self.reference}: loading it runs "
            f"{self.file}{state}"
        )


def _references(value: Any) -> list[str]:
    # Entries are "module.Class", or [slow, fast] pairs of which either may be null.
    items = value if isinstance(value, list) else [value]
    return [item for item in items if isinstance(item, str) and item]


def remote_code(directory: StrPath, what: str = "tokenizer") -> list[RemoteCode]:
    """The custom code that loading ``what`` ("tokenizer", "model" or "all") from ``directory``
    would import. ``repo--module.Class`` references (code in another hub repository) are listed
    with the file they would fetch, which an offline run can never find."""
    directory = Path(directory)
    names = (
        AUTO_MAP_FILES["tokenizer"] + AUTO_MAP_FILES["model"]
        if what == "all"
        else AUTO_MAP_FILES[what]
    )
    found: list[RemoteCode] = []
    for name in names:
        path = directory / name
        if not path.is_file():
            continue
        auto_map = json.loads(path.read_text(encoding="utf-8")).get("auto_map") or {}
        for loader, value in sorted(auto_map.items()):
            for reference in _references(value):
                module = reference.split("--")[-1].rsplit(".", 1)[0]
                file = directory / (module.replace(".", "/") + ".py")
                found.append(RemoteCode(path, loader, reference, file))
    return found


def check_trust(directory: StrPath, trusted: bool, what: str = "tokenizer") -> list[RemoteCode]:
    """The custom code loading ``what`` would run; raises ``RemoteCodeRefused`` when there is
    some and ``trusted`` is false. Call it before any work."""
    entries = remote_code(directory, what)
    if entries and not trusted:
        lines = "\n  ".join(entry.describe() for entry in entries)
        raise RemoteCodeRefused(
            f"{directory}: loading its {what} runs custom Python code shipped with it:\n  {lines}\n"
            f"Read those files, then pass {TRUST_FLAG} to allow it (nothing was done)."
        )
    missing = [entry for entry in entries if not entry.file.is_file()]
    if missing:
        raise RemoteCodeRefused(
            f"{directory}: {missing[0].describe()}, which is not in the directory (an offline "
            "run cannot fetch it); copy the model repository's .py files beside its config"
        )
    return entries


def remote_code_record(directory: StrPath, trusted: bool, what: str = "tokenizer") -> dict:
    """What an artifact's lineage records about custom code: whether it was allowed, and a
    fingerprint of the files that ran (so other code behind the same names is told apart)."""
    entries = remote_code(directory, what)
    files = sorted({entry.file for entry in entries if entry.file.is_file()})
    return {
        "trust_remote_code": bool(trusted),
        "remote_code_files": [file.name for file in files],
        **({"remote_code_fingerprint": fingerprint_files(files, Path(directory))} if files else {}),
    }
