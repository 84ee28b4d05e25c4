"""The streaming hand-off: a hidden-state dataset that is trained on while it is written.

A stream is the work directory ``OUT.partial`` of ``eagle3-extract run --stream --out OUT``;
the same shard format and checksums as a finished dataset, plus files that say what is
sealed and what was consumed::

    OUT.partial/
      target_head.safetensors       written before the first shard
      shards/<name>.safetensors     sealed shards (written under a temporary name, renamed);
                                    deleted by the consumer once reclaimed
      _work/run.json                the producer's identity (what a restart must share)
      _work/stream.json             a hidden_states header (planned totals), the shard plan
                                    and the disk budget: what the consumer checks lineage on
      _work/fragments/<name>.json   a sealed shard's manifest rows (written after the shard)
      _work/consumed/<name>.json    the consumer's receipt: trained on and checkpointed. Only
                                    after it exists may the shard file be deleted
      _work/end.json                every planned shard is sealed: the producer is done
      _work/consumer_stopped.json   the consumer finished (or stopped early): it reclaims
                                    nothing more, so a producer paused on its budget stops

The rules both sides rely on: the consumer reads a shard only once its fragment exists, so
never a torn one; the producer counts a shard done when its fragment exists and either the
file is whole or a receipt exists; fragments are never deleted, so a restarted consumer can
recompute its data order over shards that are gone.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_schemas.contract.header import Header
from eagle3_schemas.contract.lineage import fingerprint_json
from eagle3_schemas.contract.validate import header_violations
from eagle3_schemas.io.atomic import write_json_atomic
from eagle3_schemas.io.safetensors_format import SafetensorsFormatError, read_safetensors
from eagle3_schemas.layouts.hidden_states import (
    PER_TOKEN_TENSORS,
    SHARD_DIR,
    checksum_algorithm,
    resolve_shard_path,
    row_checksum,
)

PARTIAL_SUFFIX = ".partial"
WORK = "_work"
STREAM_FILE = f"{WORK}/stream.json"
FRAGMENTS = f"{WORK}/fragments"
CONSUMED = f"{WORK}/consumed"
END_FILE = f"{WORK}/end.json"
CONSUMER_STOPPED = f"{WORK}/consumer_stopped.json"
TARGET_HEAD = "target_head.safetensors"


def partial_dir(final: Path) -> Path:
    """Where the run that will publish ``final`` works (and a stream lives)."""
    return final.with_name(final.name + PARTIAL_SUFFIX)


@dataclass
class ManifestRow:
    sample_id: str
    row_start: int
    num_tokens: int
    num_loss_tokens: int
    checksum: str


@dataclass
class Fragment:
    """What one sealed shard contributes to the manifest (or, if every sample was rejected,
    only its rejections: no shard file is written then)."""

    name: str
    shard: str | None
    file_bytes: int
    rows: list[ManifestRow] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [asdict(r) for r in self.rows]}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Fragment:
        return cls(
            name=obj["name"],
            shard=obj["shard"],
            file_bytes=obj["file_bytes"],
            rows=[ManifestRow(**r) for r in obj["rows"]],
            rejected=list(obj["rejected"]),
        )


@dataclass(frozen=True)
class PlannedShard:
    """A shard the producer will write: its name and the (sample id, tokens) it will hold."""

    name: str
    samples: tuple[tuple[str, int], ...]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.samples)


@dataclass(frozen=True)
class StreamInfo:
    root: Path
    header: Header
    plan: tuple[PlannedShard, ...]
    bytes_per_token: int
    disk_budget_bytes: int | None
    epochs: int  # passes of the dataset the plan holds (one per training epoch)

    def planned_bytes(self, shard: PlannedShard) -> int:
        """The shard file's size as planned (tensor bytes; the JSON header is extra)."""
        return shard.num_tokens * self.bytes_per_token + 8 * (len(shard.samples) + 1)


def stream_section(
    plan: list[tuple[str, list[tuple[str, int]]]],
    bytes_per_token: int,
    budget: int | None,
    epochs: int = 1,
) -> dict[str, Any]:
    """The ``stream`` field of ``_work/stream.json``'s header. ``epochs`` > 1: the plan holds
    the dataset's shards once per training epoch, epoch by epoch (re-extraction)."""
    return {
        "plan": [{"name": name, "samples": [list(s) for s in samples]} for name, samples in plan],
        "bytes_per_token": bytes_per_token,
        "disk_budget_bytes": budget,
        "epochs": epochs,
    }


def read_stream(root: Path) -> StreamInfo:
    """The stream's header and plan (raises OSError / ValueError naming the file)."""
    path = root / STREAM_FILE
    obj = json.loads(path.read_text(encoding="utf-8"))
    header = Header.from_json(obj, str(path))
    section = header.fields.get("stream")
    if not isinstance(section, dict) or "plan" not in section:
        raise ValueError(f"{path}: no 'stream' section (not written by eagle3-extract --stream)")
    plan = tuple(
        PlannedShard(s["name"], tuple((str(i), int(n)) for i, n in s["samples"]))
        for s in section["plan"]
    )
    return StreamInfo(
        root,
        header,
        plan,
        int(section["bytes_per_token"]),
        section.get("disk_budget_bytes"),
        int(section.get("epochs", 1)),
    )


def fingerprint_stream(info: StreamInfo) -> str:
    """The lineage fingerprint of a stream (a draft's hidden_states_fingerprint): its header,
    which names the inputs, layer ids, storage and every planned (sample id, length), without
    the disk budget (a restart may change it). Stable while the stream grows."""
    header = info.header.to_json()
    header["stream"] = {k: v for k, v in header["stream"].items() if k != "disk_budget_bytes"}
    return fingerprint_json({"stream": header})


def read_fragment(root: Path, name: str) -> Fragment | None:
    """The fragment of shard ``name`` when it is sealed, else None."""
    path = root / FRAGMENTS / f"{name}.json"
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    return Fragment.from_json(json.loads(text))


def consumed(root: Path, name: str) -> bool:
    return (root / CONSUMED / f"{name}.json").is_file()


def reclaim(root: Path, fragment: Fragment, receipt: dict[str, Any]) -> int:
    """Write the consumer's receipt for ``fragment``'s shard, then delete the shard file.

    Idempotent (a consumer killed in between redoes it). Returns the bytes freed.
    """
    write_json_atomic(root / CONSUMED / f"{fragment.name}.json", receipt)
    if fragment.shard is None:
        return 0
    path = root / fragment.shard
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


def ended(root: Path) -> bool:
    return (root / END_FILE).is_file()


def shard_bytes_on_disk(root: Path) -> int:
    """Bytes under ``shards/``, shards being written included."""
    total = 0
    try:
        entries = list(os.scandir(root / SHARD_DIR))
    except FileNotFoundError:
        return 0
    for entry in entries:
        try:
            total += entry.stat().st_size
        except FileNotFoundError:  # renamed or reclaimed meanwhile
            continue
    return total


def check_sealed_shard(
    root: Path, fragment: Fragment, schema_version: int, deep: bool = True
) -> list[str]:
    """Problems of one sealed shard against its fragment, as a finished dataset's checks see
    them: the file's size, its per-token tensors, the rows tiling it, and (``deep``) every
    row's checksum by the rule of the stream's schema version. Empty when sound."""
    if fragment.shard is None:
        return []
    where = f"{root / fragment.shard}"
    try:
        path = resolve_shard_path(root, fragment.shard)
        if path.stat().st_size != fragment.file_bytes:
            return [
                f"{where}: {path.stat().st_size} bytes, the fragment says {fragment.file_bytes}"
            ]
        st = read_safetensors(path)
    except (OSError, ValueError, SafetensorsFormatError) as e:
        return [f"{where}: unreadable ({e})"]
    per_token = {n: t for n, t in st.tensors.items() if n in PER_TOKEN_TENSORS}
    total = {t.shape[0] for t in per_token.values()}
    if len(total) != 1:
        return [f"{where}: per-token tensors disagree on the token count: {sorted(total)}"]
    rows_total = total.pop()
    problems, cursor = [], 0
    for row in fragment.rows:
        if row.row_start != cursor or row.num_tokens < 1:
            problems.append(
                f"{where}: sample {row.sample_id!r} rows [{row.row_start}, "
                f"{row.row_start + row.num_tokens}) do not follow the previous sample's end {cursor}"
            )
        cursor = row.row_start + row.num_tokens
    if cursor != rows_total:
        problems.append(f"{where}: manifest rows end at {cursor}, the tensors hold {rows_total}")
    if problems or not deep:
        return problems
    prefix = checksum_algorithm(schema_version) + ":"
    for row in fragment.rows:
        got = row_checksum(st, row.row_start, row.num_tokens, schema_version)
        if not row.checksum.startswith(prefix) or got != row.checksum:
            problems.append(
                f"{where}: sample {row.sample_id!r}: checksum {row.checksum!r} != {got!r} "
                "(torn or altered shard)"
            )
    return problems


def check_stream_header(info: StreamInfo) -> list[str]:
    """The stream header against its schema version's header rules (fields, lineage keys),
    as ``validate`` checks a finished dataset's dataset.json."""
    if info.header.artifact != "hidden_states":
        return [
            f"{info.root / STREAM_FILE}: artifact {info.header.artifact!r}, expected hidden_states"
        ]
    return [str(v) for v in header_violations(info.header, str(info.root / STREAM_FILE))]
