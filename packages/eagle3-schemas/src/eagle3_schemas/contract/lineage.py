"""Lineage fingerprints: what every artifact records about what it was made from.

All fingerprints are ``"sha256:<hex>"`` strings. Stages compute them only through these
functions, so the writer of an artifact and the stage that checks it always agree.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_schemas.contract.header import read_header
from eagle3_schemas.io.fingerprint import (
    canonical_json,
    fingerprint_file,
    fingerprint_files,
    fingerprint_json,
    fingerprint_text,
    fingerprint_vocab_map,
    hex_digest,
)
from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_schemas.layouts.remote_code import remote_code

# The primitives are re-exported: stages compute every fingerprint through this module.
__all__ = [
    "TOKENIZER_FILES",
    "VOLATILE_CONFIG_KEYS",
    "fingerprint_artifact",
    "fingerprint_file",
    "fingerprint_files",
    "fingerprint_json",
    "fingerprint_model_dir",
    "fingerprint_text",
    "fingerprint_tokenizer_dir",
    "fingerprint_vocab_map",
    "lineage_mismatches",
]

# Files that define a tokenizer's behaviour, chat template included, in every HF layout.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "tiktoken.model",
    "vocab.txt",
)
# Keys of a model config.json that name the file's history, not the model.
VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype")
WEIGHT_SAMPLE_BYTES = 1 << 20


def fingerprint_tokenizer_dir(directory: str | os.PathLike[str]) -> str:
    """Vocabulary, merges, special tokens and chat template files of a HF tokenizer directory,
    and the Python files its ``auto_map`` names (a custom tokenizer's behaviour is its code)."""
    directory = Path(directory)
    present = [directory / n for n in TOKENIZER_FILES if (directory / n).is_file()]
    if not present:
        raise FileNotFoundError(
            f"{directory}: no tokenizer files (looked for {', '.join(TOKENIZER_FILES)})"
        )
    code = {entry.file for entry in remote_code(directory, "tokenizer") if entry.file.is_file()}
    return fingerprint_files([*present, *sorted(code)], directory)


def fingerprint_model_dir(directory: str | os.PathLike[str]) -> str:
    """A target model directory: its config plus, per weight file, size, header and first MiB.

    Hashing every weight byte of a 1 TB target would take longer than the job it guards;
    the safetensors headers pin every tensor's name, dtype and shape, and a sample of the data
    tells fine-tunes of the same architecture apart.
    """
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    for key in VOLATILE_CONFIG_KEYS:
        config.pop(key, None)
    h = hashlib.sha256(canonical_json(config))
    for path in sorted(directory.glob("*.safetensors")):
        parsed = read_safetensors(path)
        entries = {n: [t.dtype, list(t.shape), t.end - t.start] for n, t in parsed.tensors.items()}
        size = str(path.stat().st_size).encode()
        h.update(b"\0".join([path.name.encode(), size, canonical_json(entries)]))
        first = min((t.start for t in parsed.tensors.values()), default=0)
        with open(path, "rb") as f:
            f.seek(first)
            h.update(f.read(WEIGHT_SAMPLE_BYTES))
    return hex_digest(h)


def fingerprint_artifact(path: str | os.PathLike[str]) -> str:
    """The fingerprint downstream artifacts record for ``path`` (kind detected from the header)."""
    path = Path(path)
    kind = read_header(path).artifact
    if kind == "vocab_map":
        st = read_safetensors(path)
        return fingerprint_vocab_map(st.array("d2t"), st.array("t2d"))
    if kind == "hidden_states":
        manifest = pq.read_table(path / "manifest.parquet", columns=["sample_id", "checksum"])
        rows = sorted(zip(*manifest.to_pydict().values(), strict=True))  # (sample_id, checksum)
        header = json.loads((path / "dataset.json").read_text(encoding="utf-8"))
        return fingerprint_json({"header": header, "rows": rows})
    if kind == "draft_checkpoint":
        return fingerprint_files([path / "config.json", path / "model.safetensors"], path)
    if path.is_dir():
        return fingerprint_files([p for p in path.rglob("*") if p.is_file()], path)
    return fingerprint_file(path)


def lineage_mismatches(
    expected: Mapping[str, Any], found: Mapping[str, Any], expected_from: str, found_from: str
) -> list[str]:
    """One message per key of ``expected`` whose value differs in ``found``, naming both sides."""
    problems = []
    for key, want in expected.items():
        if key not in found:
            problems.append(
                f"lineage {key!r}: {found_from} does not record it; {expected_from} has {want!r}"
            )
        elif found[key] != want:
            problems.append(
                f"lineage {key!r}: {found_from} has {found[key]!r} but {expected_from} has {want!r}"
            )
    return problems
