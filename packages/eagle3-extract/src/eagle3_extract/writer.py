"""Shard writer: captured states of one planned shard -> one packed safetensors file + fragment.

A shard is written whole under a temporary name, fsynced and renamed (eagle3_schemas.io.atomic);
then its *fragment* (the manifest rows and the rejected samples of that shard) is written the
same way. A fragment therefore only exists for a complete shard, which is what makes a run
resumable after kill -9 at any point: see ``workdir.py``.

The file is serialized here rather than through ``safetensors.torch.save_file``: that builds
the whole file in memory first (one extra copy of every byte); this writes each tensor's bytes
straight from the tensor, and hashes the per-sample checksums on a second thread meanwhile
(hashlib releases the GIL on large buffers).
"""

from __future__ import annotations

import json
import logging
import math
import queue
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_extract.plan import ShardPlan, bytes_per_token
from eagle3_extract.samples import Sample
from eagle3_extract.storage import TORCH_DTYPES, encode
from eagle3_schemas.contract.stream import Fragment, ManifestRow
from eagle3_schemas.io.atomic import atomic_path, write_json_atomic
from eagle3_schemas.io.diskspace import check_free, disk_full, is_disk_full
from eagle3_schemas.layouts.hidden_states import PER_TOKEN_TENSORS, SHARD_DIR, checksum_rows

log = logging.getLogger(__name__)

SAFETENSORS_DTYPES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.uint8: "U8",
}


# Beside a shard's states: its safetensors header, per-sample tensors and its fragment.
SHARD_MARGIN = 64 << 10


class CaptureError(RuntimeError):
    """A backend returned something other than what was asked for; nothing is written."""


@dataclass
class CapturedSample:
    """States of one sample for the requested layer ids, aux ids first then id N.

    ``states`` is ``[T, n_aux + 1, H]``: ``states[:, :n_aux]`` are the aux layers in ascending
    id order, ``states[:, n_aux]`` is id N (last decoder layer output before the final norm).
    """

    sample: Sample
    states: torch.Tensor


def _raw(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 numpy view (no copy for contiguous CPU tensors)."""
    t = t.detach().contiguous()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.reshape(-1).view(torch.uint8).numpy()


def save_safetensors(
    path: Path,
    tensors: dict[str, torch.Tensor],
    fill: Iterator[tuple[str, int]] | None = None,
) -> int:
    """Write ``tensors`` as safetensors atomically, streaming each tensor's bytes; returns size.

    ``fill``: packing still in progress. An iterator that fills ``tensors`` in place and yields
    ``(name, rows_ready)`` as rows become final, in file (name) order; those bytes are written on
    a second thread right away, so packing overlaps the disk write. An exception from ``fill``
    aborts the write (no file is left).
    """
    header: dict[str, Any] = {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    raw_header += b" " * (-len(raw_header) % 8)  # data starts 8-byte aligned, as safetensors does
    pending: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=8)
    with atomic_path(path) as tmp, open(tmp, "wb", buffering=0) as f:
        f.write(struct.pack("<Q", len(raw_header)) + raw_header)

        def drain() -> None:
            try:
                while (chunk := pending.get()) is not None:
                    data = memoryview(chunk)
                    while data:  # unbuffered write may be partial
                        data = data[f.write(data) :]
            except BaseException:
                # a failed write (a full disk) still takes what the packer puts, up to its end
                # mark: a bounded queue nobody empties would block the packer for good
                while pending.get() is not None:
                    pass
                raise

        with ThreadPoolExecutor(1) as pool:
            writing = pool.submit(drain)
            written = dict.fromkeys(names, 0)
            cursor = 0

            def push(name: str, rows: int) -> None:
                t = tensors[name]
                if rows > written[name]:
                    pending.put(_raw(t[written[name] : rows] if t.dim() else t))
                    written[name] = rows

            try:
                for name, rows in fill or ():
                    while names[cursor] != name:  # earlier tensors are final by now
                        push(names[cursor], _rows(tensors[names[cursor]]))
                        cursor += 1
                    push(name, rows)
                for name in names[cursor:]:
                    push(name, _rows(tensors[name]))
            finally:
                pending.put(None)
            writing.result()
    return 8 + len(raw_header) + offset


def _rows(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


# One checksum thread: XXH3 hashes ~30 GB/s per core, far above any disk; a second thread
# only took the core the write's page-cache copy runs on (measured: 0.81 -> 0.88 of raw).
HASH_THREADS = 1


def _checksums(tensors: dict[str, torch.Tensor], spans: Sequence[tuple[int, int]]) -> list[str]:
    per_token = {name: t for name, t in tensors.items() if name in PER_TOKEN_TENSORS}
    raws = {name: _raw(t) for name, t in per_token.items()}
    row_bytes = {name: (raws[name].nbytes // max(t.shape[0], 1)) for name, t in per_token.items()}

    def one(span: tuple[int, int]) -> str:
        a, b = span
        return checksum_rows(
            {n: memoryview(raws[n][a * row_bytes[n] : b * row_bytes[n]]) for n in raws}
        )

    with ThreadPoolExecutor(HASH_THREADS) as pool:
        return list(pool.map(one, spans))


def check_captured(
    plan: ShardPlan, captured: Sequence[CapturedSample], n_ids: int, hidden: int
) -> None:
    """Every planned sample, in plan order, with states of the requested shape; else raise."""
    got = [c.sample.sample_id for c in captured]
    want = [s.sample_id for s in plan.samples]
    if got != want:
        raise CaptureError(
            f"shard {plan.name}: backend returned samples {got[:5]}... but the plan holds "
            f"{want[:5]}... ({len(got)} vs {len(want)} samples)"
        )
    for c in captured:
        shape = (c.sample.num_tokens, n_ids, hidden)
        if tuple(c.states.shape) != shape:
            raise CaptureError(
                f"shard {plan.name}, sample {c.sample.sample_id!r}: states have shape "
                f"{list(c.states.shape)}, expected [T={shape[0]}, n_ids={n_ids}, H={hidden}]"
            )


def _finite(t: torch.Tensor) -> bool:
    """All values finite: one fast reduction (min and max propagate NaN; Inf shows in them)."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t)
    return bool(torch.isfinite(low) and torch.isfinite(high))


@dataclass
class _Packed:
    tensors: dict[str, torch.Tensor]
    spans: list[tuple[int, int]]


# Samples packed between two hand-offs to the writing thread (bounds the latency of the overlap).
PACK_CHUNK_TOKENS = 512


class _NonFinite(Exception):
    """Raised inside a shard write to abort it: some sample holds NaN/Inf."""


class _Scratch:
    """One reusable byte buffer holding the hidden-state tensors of the shard being written.

    Fresh memory costs a page fault per 4 KiB on first write (about as much time as the copy
    itself); shards are written one at a time, so one grow-only buffer serves them all. The
    lock keeps two concurrent writers (none in this package) from sharing it.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def tensors(
        self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    ) -> dict[str, torch.Tensor]:
        sizes = {
            name: math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            for name, (shape, dtype) in specs.items()
        }
        padded = {name: -(-size // 64) * 64 for name, size in sizes.items()}  # aligned views
        if self._buffer.numel() < sum(padded.values()):
            self._buffer = torch.empty(sum(padded.values()), dtype=torch.uint8)
        out, offset = {}, 0
        for name, (shape, dtype) in specs.items():
            out[name] = self._buffer[offset : offset + sizes[name]].view(dtype).view(shape)
            offset += padded[name]
        return out


_SCRATCH = _Scratch()


def _allocate(captured: Sequence[CapturedSample], n_aux: int, hidden: int, storage: str) -> _Packed:
    """The shard's tensors, hidden states still empty; token ids, loss mask, cu_seqlens filled."""
    lengths = [c.sample.num_tokens for c in captured]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    total = int(cu[-1])
    dtype = TORCH_DTYPES[storage]
    specs = {
        "aux_hidden_states": ((total, n_aux, hidden), dtype),
        "last_hidden_state": ((total, hidden), dtype),
    }
    if storage == "fp8_e4m3":
        specs["aux_hidden_states_scale"] = ((total, n_aux), torch.float32)
        specs["last_hidden_state_scale"] = ((total,), torch.float32)
    tensors = _SCRATCH.tensors(specs)
    tensors |= {
        "input_ids": torch.from_numpy(np.concatenate([c.sample.input_ids for c in captured])),
        "loss_mask": torch.from_numpy(np.concatenate([c.sample.loss_mask for c in captured])),
        "cu_seqlens": torch.from_numpy(cu),
    }
    return _Packed(tensors, [(int(cu[i]), int(cu[i + 1])) for i in range(len(captured))])


_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src``. Same dtype: a bit copy through numpy (3-4x faster than torch's strided
    bf16 copy here); otherwise torch converts."""
    if dst.dtype == src.dtype and src.device.type == "cpu":
        ints = _SAME_SIZE_INTS[dst.element_size()]
        np.copyto(dst.view(ints).numpy(), src.view(ints).numpy())
    else:
        dst.copy_(src)


def _fill(
    packed: _Packed,
    captured: Sequence[CapturedSample],
    n_aux: int,
    storage: str,
    on_packed: Callable[[], None],
) -> Iterator[tuple[str, int]]:
    """Copy every sample's states into the shard tensors, converting to the storage dtype on
    the way, and report progress in file order: all aux rows first, then the last layer.
    ``on_packed`` runs once everything is packed and finite (the file may still be writing)."""
    t = packed.tensors
    for name, select in (("aux_hidden_states", slice(0, n_aux)), ("last_hidden_state", n_aux)):
        scale = t.get(f"{name}_scale")
        ready = 0
        for c, (a, b) in zip(captured, packed.spans, strict=True):
            states = c.states[:, select]
            if scale is not None:
                encoded = encode(states, storage)
                t[name][a:b], scale[a:b] = encoded.values, encoded.scale
            else:
                _copy(t[name][a:b], states)
            if b - ready >= PACK_CHUNK_TOKENS:
                yield name, b
                ready = b
        yield name, len(t[name])
    if not all(_finite(t[n]) for n in _checked(storage)):
        raise _NonFinite
    on_packed()


# What must be finite: the stored values, or for fp8 the scales (a NaN/Inf anywhere in a row makes
# that row's max, hence its scale, NaN/Inf; finite rows quantize to finite values).
def _checked(storage: str) -> tuple[str, ...]:
    if storage == "fp8_e4m3":
        return ("aux_hidden_states_scale", "last_hidden_state_scale")
    return ("aux_hidden_states", "last_hidden_state")


def _nonfinite_reason(packed: _Packed, index: int, storage: str) -> str | None:
    a, b = packed.spans[index]
    for name in _checked(storage):
        rows = packed.tensors[name][a:b]
        if not _finite(rows):
            bad = ~torch.isfinite(rows.float()).reshape(b - a, -1)
            first = int(bad.any(dim=1).nonzero()[0].item())
            what = "scales" if storage == "fp8_e4m3" else "values"
            return (
                f"{int(bad.sum())} NaN/Inf {what} in {name} (first at position {first}); "
                "NaN/Inf computed by the target, or overflow of the storage dtype"
            )
    return None


def _write_packed(
    path: Path, packed: _Packed, captured: Sequence[CapturedSample], n_aux: int, storage: str
) -> tuple[int, list[str]]:
    """Pack ``captured`` into ``packed`` while the file is written; hash the rows meanwhile.

    Returns (file size, per-sample checksums). Raises _NonFinite, leaving no file, when some
    sample holds NaN/Inf.
    """
    with ThreadPoolExecutor(1) as pool:
        hashing: list[Future[list[str]]] = []

        def start_hashing() -> None:  # once packed: checksums overlap the tail of the write
            hashing.append(pool.submit(_checksums, packed.tensors, packed.spans))

        fill = _fill(packed, captured, n_aux, storage, start_hashing)
        size = save_safetensors(path, packed.tensors, fill)
        return size, hashing[0].result()


def _reject(
    plan: ShardPlan,
    packed: _Packed,
    captured: Sequence[CapturedSample],
    storage: str,
    rejected: list[dict[str, Any]],
) -> list[CapturedSample]:
    """Log and record the samples holding NaN/Inf; return the others."""
    kept = []
    for i, c in enumerate(captured):
        reason = _nonfinite_reason(packed, i, storage)
        if reason is None:
            kept.append(c)
            continue
        s = c.sample
        log.warning(
            "rejected sample %r (tokenized row %d, shard %s): %s",
            s.sample_id,
            s.index,
            plan.name,
            reason,
        )
        rejected.append({"sample_id": s.sample_id, "index": s.index, "reason": reason})
    return kept


def shard_room(plans: Sequence[ShardPlan], per_token: int) -> int:
    """Bytes the shards of ``plans`` need on disk (``per_token``: ``plan.bytes_per_token``)."""
    return sum(p.num_tokens * per_token + SHARD_MARGIN for p in plans)


def check_room(dataset_dir: Path, plans: Sequence[ShardPlan], per_token: int) -> None:
    """Raise ``DiskFull`` naming the shards folder unless the shards of ``plans`` fit: called
    before their capture (and again before each write), so a full disk stops before work that
    could not be kept."""
    what = f"shard {plans[0].name}" + (f"..{plans[-1].name}" if len(plans) > 1 else "")
    check_free(dataset_dir / SHARD_DIR, what, shard_room(plans, per_token))


def write_shard(
    dataset_dir: Path,
    fragments_dir: Path,
    plan: ShardPlan,
    captured: Sequence[CapturedSample],
    *,
    n_aux: int,
    hidden_size: int,
    storage_dtype: str,
) -> Fragment:
    """Encode, check, pack and write one shard, then its fragment. Returns the fragment.

    Samples with NaN/Inf (as computed, or after conversion to the storage dtype) are left out
    and logged; the fragment lists them. If all are, no shard file is written. A write that
    hits a full disk leaves nothing half-written and raises ``DiskFull`` naming the shards
    folder.
    """
    check_captured(plan, captured, n_aux + 1, hidden_size)
    fragment = Fragment(name=plan.name, shard=None, file_bytes=0)
    kept = list(captured)
    try:
        with _SCRATCH.lock:
            _write_kept(dataset_dir, plan, kept, fragment, n_aux, hidden_size, storage_dtype)
        write_json_atomic(fragments_dir / f"{plan.name}.json", fragment.to_json())
    except Exception as e:  # the writes are atomic: no partial shard or fragment is left
        if not is_disk_full(e):
            raise
        needed = shard_room([plan], bytes_per_token(n_aux, hidden_size, storage_dtype))
        raise disk_full(dataset_dir / SHARD_DIR, f"shard {plan.name}", needed, e) from e
    return fragment


def _write_kept(
    dataset_dir: Path,
    plan: ShardPlan,
    kept: list[CapturedSample],
    fragment: Fragment,
    n_aux: int,
    hidden_size: int,
    storage_dtype: str,
) -> None:
    while kept:
        packed = _allocate(kept, n_aux, hidden_size, storage_dtype)
        try:
            fragment.file_bytes, checksums = _write_packed(
                dataset_dir / plan.rel_path, packed, kept, n_aux, storage_dtype
            )
        except _NonFinite:  # rare: the write was aborted; drop the culprits, write the rest
            kept = _reject(plan, packed, kept, storage_dtype, fragment.rejected)
            continue
        fragment.shard = plan.rel_path
        fragment.rows = [
            ManifestRow(c.sample.sample_id, a, b - a, int(c.sample.loss_mask.sum()), checksum)
            for c, (a, b), checksum in zip(kept, packed.spans, checksums, strict=True)
        ]
        break
