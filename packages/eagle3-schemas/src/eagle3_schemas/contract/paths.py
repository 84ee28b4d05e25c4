"""Path arguments: a bad one is refused before any work, naming the argument, the path and
what was expected.

Every stage takes input artifacts, plain inputs (model and tokenizer directories, raw data, config
files) and writes one output. The checks they all need live here, once. The form an artifact kind
takes on disk (a ``.parquet`` file, a ``.safetensors`` file, a directory) is read from its schema
file, so a command cannot disagree with the contract about the name its output needs.

Every message reads ``ARGUMENT PATH: what is wrong; expected WHAT``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from eagle3_schemas.contract.header import read_header
from eagle3_schemas.contract.registry import artifact_kinds, load_schema

StrPath = str | os.PathLike[str]


class PathArgumentError(ValueError):
    """A path given to a command cannot be used; raised before the command does any work."""


def refuse(flag: str, path: StrPath, problem: str, expected: str) -> NoReturn:
    """Raise the one message form every path check uses; for a stage's own path rules."""
    raise PathArgumentError(f"{flag} {path}: {problem}; expected {expected}")


# ---- what the contract says about each kind ---------------------------------------------------


@functools.cache
def artifact_suffix(kind: str) -> str | None:
    """The file suffix an artifact of ``kind`` needs (``.parquet``, ``.safetensors``), or None
    for a directory artifact. Read from the schema: a single-file artifact's one file is ``.``."""
    whole = [spec for spec in load_schema(kind)["files"].values() if spec["path"] == "."]
    return f".{whole[0]['format']}" if whole else None


def describe_artifact(kind: str) -> str:
    """``'a tokenized artifact (a .parquet file)'``: the expectation, for messages."""
    suffix = artifact_suffix(kind)
    return f"{artifact_noun(kind)} ({f'a {suffix} file' if suffix else 'a directory'})"


def artifact_noun(kind: str) -> str:
    """``'an eval_report artifact'``, ``'a tokenized artifact'``."""
    return f"{'an' if kind[:1] in tuple('aeiou') else 'a'} {kind} artifact"


def file_artifact_suffixes() -> set[str]:
    """Suffixes that name a single-file artifact; a directory artifact's name must not end so."""
    return {s for kind in artifact_kinds() if (s := artifact_suffix(kind)) is not None}


# ---- inputs ----------------------------------------------------------------------------------


def check_input_file(path: StrPath, flag: str, expected: str, suffixes: Sequence[str] = ()) -> None:
    """``path`` is an existing file, ending in one of ``suffixes`` when any are given."""
    path = Path(path)
    if not path.exists():
        refuse(flag, path, "does not exist", expected)
    if not path.is_file():
        refuse(flag, path, "is a directory, not a file", expected)
    if suffixes and path.suffix not in suffixes:
        refuse(flag, path, f"has the suffix {path.suffix or '(none)'!r}", expected)


def check_input_dir(
    path: StrPath, flag: str, expected: str, must_contain: Sequence[str] = ()
) -> None:
    """``path`` is an existing directory holding every file named in ``must_contain``."""
    path = Path(path)
    if not path.exists():
        refuse(flag, path, "does not exist", expected)
    if not path.is_dir():
        refuse(flag, path, "is a file, not a directory", expected)
    for name in must_contain:
        if not (path / name).is_file():
            refuse(flag, path, f"has no {name}", expected)


def check_input_artifact(path: StrPath, kind: str, flag: str) -> None:
    """``path`` has the form of a ``kind`` artifact and its header says it is one.

    Only the header is read (Parquet footer, safetensors header or the directory's JSON file):
    full validation stays with each stage's preflight.
    """
    expected = describe_artifact(kind)
    suffix = artifact_suffix(kind)
    if suffix is None:
        check_input_dir(path, flag, expected)
    else:
        check_input_file(path, flag, expected, (suffix,))
    try:
        found = read_header(path).artifact
    except (ValueError, OSError) as e:  # ArtifactError, SafetensorsFormatError, unreadable file
        refuse(flag, path, f"has no readable artifact header ({e})", expected)
    if found != kind:
        refuse(flag, path, f"is {artifact_noun(str(found))}", expected)


# ---- outputs ---------------------------------------------------------------------------------


def check_parent_creatable(path: StrPath, flag: str, expected: str) -> None:
    """The directories above ``path`` exist or can be created: the nearest existing ancestor
    is a writable directory."""
    path = Path(path)
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        refuse(flag, path, f"cannot be created: {ancestor} is a file, not a directory", expected)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        refuse(flag, path, f"cannot be created: {ancestor} is not writable", expected)


def check_output(
    path: StrPath,
    flag: str,
    expected: str,
    *,
    suffix: str | None = None,
    directory: bool = False,
    may_exist: bool = False,
) -> None:
    """An output the command creates: a file ending in ``suffix`` or a directory (whose name
    ends in no artifact file suffix), not there yet unless ``may_exist`` (a command that resumes
    into it), and somewhere it can be created."""
    path = Path(path)
    if suffix is not None and path.suffix != suffix:
        hint = f" (e.g. {path.with_name(path.name + suffix)})" if not path.suffix else ""
        refuse(flag, path, f"does not end in {suffix}{hint}", expected)
    if directory and path.suffix in file_artifact_suffixes():
        refuse(flag, path, f"names a {path.suffix} file, but the output is a directory", expected)
    if path.exists() or path.is_symlink():
        if not may_exist:
            refuse(flag, path, "already exists; refusing to overwrite it", expected)
        if directory and not path.is_dir():
            refuse(flag, path, "exists and is a file, not a directory", expected)
        if not directory and path.is_dir():
            refuse(flag, path, "exists and is a directory, not a file", expected)
    check_parent_creatable(path, flag, expected)


def check_output_artifact(path: StrPath, kind: str, flag: str, *, may_exist: bool = False) -> None:
    """An output ``kind`` artifact: the form its schema gives it, and not there yet (unless
    ``may_exist``: the command itself decides what an existing one means)."""
    suffix = artifact_suffix(kind)
    check_output(
        path,
        flag,
        describe_artifact(kind),
        suffix=suffix,
        directory=suffix is None,
        may_exist=may_exist,
    )
