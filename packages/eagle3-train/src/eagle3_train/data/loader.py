"""Reading planned batches from the hidden-state dataset's shards (plans: dataset.py).

- **Read**: a batch is one packed sequence. Each sample's rows of each tensor are one
  ``preadv`` from the shard file straight into the batch buffer (no intermediate arrays, no
  whole-shard loads, no mmap page faults), kept in the storage dtype; conversion happens on
  the device.
- **Workers**: ``num_workers`` threads read ahead (``pread`` releases the GIL); batches are
  handed out in plan order whatever the number of threads. Memory is bounded by
  ``num_workers × prefetch + 2`` batches.
- **Verify** (``verify``, the trainer's data.verify_rows): each sample's rows are hashed as
  read, by the dataset's schema-version rule (eagle3_schemas.layouts.hidden_states), and compared with
  the manifest's checksum. A mismatch raises CorruptSample naming shard, sample and rows, or
  (``verify="skip"``) zeroes the sample's rows in the batch — no loss token, so it adds nothing
  to the loss or the gradient, and the batch keeps its shape on every rank — and lists it
  under the batch's ``corrupt`` key.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from eagle3_schemas.io.safetensors_format import NUMPY_VIEWS
from eagle3_schemas.layouts.hidden_states import CHECKSUM_ALGORITHMS
from eagle3_train.data.dataset import (
    PER_TOKEN,
    SCALES,
    TORCH_VIEWS,
    Batch,
    BatchPlan,
    CorruptSample,
    HiddenStateDataset,
    ShardTensor,
)

# numpy-compatible torch dtypes of the same width, to allocate batch buffers in torch
TORCH_STORAGE = {
    name: torch.from_numpy(np.empty(0, view)).dtype for name, view in NUMPY_VIEWS.items()
}


class ShardReader:
    """Reads sample rows from shard files straight into packed batch buffers.

    Thread-safe: ``pread`` takes explicit offsets, and each thread keeps its own file
    descriptors (closing a descriptor another thread is reading from is never possible).
    ``read(plan, slot)`` with ``ring`` slots recycles that slot's buffers: pages already
    mapped and cached, no allocation per batch. The batch then carries a ``lease`` on its
    slot, and the slot is refilled only after the lease was released (``to_device`` releases
    it) and the fence given at the release has passed: a copy to the GPU enqueued from the
    slot may still be pending while the host runs steps ahead. ``pin_memory`` allocates the
    buffers page-locked for asynchronous copies to the GPU.
    """

    def __init__(
        self,
        dataset: HiddenStateDataset,
        max_open: int = 16,
        ring: int = 0,
        capacity: int = 0,
        pin_memory: bool = False,
        verify: str | None = None,
    ) -> None:
        if verify not in (None, "stop", "skip"):
            raise ValueError(f"verify: {verify!r} is not one of None, 'stop', 'skip'")
        self.dataset = dataset
        self.verify = verify
        self.max_open = max_open
        self.capacity = capacity  # rows allocated per recycled buffer (the largest batch)
        self.pin_memory = pin_memory
        self._slots: list[tuple[dict[str, torch.Tensor], list[tuple[str, memoryview, int]]] | None]
        self._slots = [None] * ring
        self._leases = [SlotState() for _ in range(ring)]
        self._local = threading.local()
        self._caches: list[OrderedDict[int, int]] = []
        self._lock = threading.Lock()

    def _fd(self, shard: int) -> int:
        cache = getattr(self._local, "fds", None)
        if cache is None:
            cache = self._local.fds = OrderedDict()
            with self._lock:
                self._caches.append(cache)
        fd = cache.get(shard)
        if fd is None:
            fd = os.open(self.dataset.shard_paths[shard], os.O_RDONLY)
            cache[shard] = fd
            while len(cache) > self.max_open:
                os.close(cache.popitem(last=False)[1])
        else:
            cache.move_to_end(shard)
        return fd

    def close(self) -> None:
        with self._lock:
            for cache in self._caches:
                while cache:
                    os.close(cache.popitem()[1])

    def __del__(self) -> None:
        self.close()

    def _fresh(self, first: dict[str, ShardTensor], rows: int) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(
                (rows, *first[name].shape[1:]),
                dtype=TORCH_STORAGE[first[name].dtype],
                pin_memory=self.pin_memory,
            )
            for name in PER_TOKEN + SCALES
            if name in first
        }

    def _buffers_for(
        self, first: dict[str, ShardTensor], total: int, slot: int | None
    ) -> tuple[dict[str, torch.Tensor], list[tuple[str, memoryview, int]]]:
        """Buffers of at least ``total`` rows and, per tensor, (name, byte view, row bytes)."""
        if slot is None or not self._slots:
            return _with_views(self._fresh(first, total))
        self._leases[slot].refill(slot)
        cached = self._slots[slot]
        if cached is None or cached[0]["input_ids"].shape[0] < total:
            cached = self._slots[slot] = _with_views(self._fresh(first, max(total, self.capacity)))
        return cached

    def read(self, plan: BatchPlan, slot: int | None = None) -> Batch:
        ds = self.dataset
        total = sum(n for _, n in plan)
        first = ds.shard_tensors[ds.shard_list[plan[0][0]]]
        buffers, targets = self._buffers_for(first, total, slot)
        cu = [0]
        pos = 0
        corrupt: list[dict[str, Any]] = []
        for idx, n in plan:
            shard = ds.shard_list[idx]
            fd = self._fd(shard)
            infos = ds.shard_tensors[shard]
            r = ds.row_start_list[idx]
            for name, view, row_bytes in targets:
                # one pread per tensor: the page cache copies straight into the batch buffer
                _pread_into(
                    fd,
                    view[pos * row_bytes : (pos + n) * row_bytes],
                    infos[name].offset + r * row_bytes,
                )
            if self.verify is not None:
                found = self._checksum(idx, n, pos, fd, infos, targets)
                if found != ds.checksum_list[idx]:
                    problem = self._corrupt(idx, found)
                    if self.verify == "stop":
                        raise CorruptSample(problem["message"])
                    for _, view, row_bytes in targets:  # no loss token: adds nothing
                        view[pos * row_bytes : (pos + n) * row_bytes] = bytes(n * row_bytes)
                    corrupt.append(problem)
            pos += n
            cu.append(pos)
        out: Batch = {
            name: buf[:total].view(TORCH_VIEWS[first[name].dtype])
            if first[name].dtype in TORCH_VIEWS
            else buf[:total]
            for name, buf in buffers.items()
        }
        out["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
        if self.pin_memory:  # copied to the GPU with the rest, non-blocking: page-locked too
            out["cu_seqlens"] = out["cu_seqlens"].pin_memory()
        out["sample_ids"] = [ds.sample_ids[idx] for idx, _ in plan]
        if slot is not None and self._slots:
            out["lease"] = self._leases[slot].lend()
        if corrupt:
            out["corrupt"] = corrupt
        return out

    def _checksum(
        self,
        idx: int,
        n: int,
        pos: int,
        fd: int,
        infos: dict[str, ShardTensor],
        targets: list[tuple[str, memoryview, int]],
    ) -> str:
        """The sample's stored rows hashed by its dataset's rule: the rows just read into the
        batch, plus (a sample longer than the batch keeps its prefix) the rest, read aside."""
        ds = self.dataset
        name, new_hasher = CHECKSUM_ALGORITHMS[ds.schema_version]
        h = new_hasher()
        full, r = ds._lengths[idx], ds.row_start_list[idx]
        for tensor, view, row_bytes in sorted(targets, key=lambda t: t[0]):
            h.update(view[pos * row_bytes : (pos + n) * row_bytes])
            if full > n:
                rest = bytearray((full - n) * row_bytes)
                _pread_into(fd, memoryview(rest), infos[tensor].offset + (r + n) * row_bytes)
                h.update(rest)
        return f"{name}:{h.hexdigest()}"

    def _corrupt(self, idx: int, found: str) -> dict[str, Any]:
        ds = self.dataset
        path = ds.shard_paths[ds.shard_list[idx]]
        r, full = ds.row_start_list[idx], ds._lengths[idx]
        message = (
            f"{path}: sample {ds.sample_ids[idx]!r} (rows {r}..{r + full - 1} of the shard, "
            f"sample {idx} of the manifest) does not match its checksum: the manifest has "
            f"{ds.checksum_list[idx]}, the stored rows hash to {found}. The shard changed after "
            "extraction (disk, copy, or a write that was cut): re-extract it, or set "
            "data.on_corrupt: skip to train without this sample"
        )
        return {
            "sample_id": ds.sample_ids[idx],
            "shard": str(path),
            "rows": [r, r + full],
            "expected": ds.checksum_list[idx],
            "found": found,
            "message": message,
        }


class RingSlotBusy(RuntimeError):
    """A ring slot was due to be refilled while the batch read into it was still held."""


class SlotState:
    """The reuse rule of one ring slot: lent with a batch, released by the batch's consumer
    (with a fence: what must complete before the slot's host buffers may be overwritten — a
    CUDA event recorded after the copies to the device were enqueued; None where nothing is
    pending), and only then refilled, once the fence has passed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lent = 0  # batches lent from this slot
        self._held = False
        self._fence: Any = None

    def lend(self) -> SlotLease:
        with self._lock:
            self._lent += 1
            self._held = True
            return SlotLease(self, self._lent)

    def release(self, lent: int, fence: Any) -> None:
        with self._lock:
            if lent != self._lent:
                raise RingSlotBusy(
                    f"a batch was released after its ring slot was refilled (batch {lent} of "
                    f"the slot, now at {self._lent}): it was kept past its validity"
                )
            self._held, self._fence = False, fence

    def refill(self, slot: int) -> None:
        """Before the slot is read into: the lent batch released, its fence passed."""
        with self._lock:
            if self._held:
                raise RingSlotBusy(
                    f"ring slot {slot} is due to be refilled, but the batch read into it was "
                    "never released: a consumer of recycled batches releases each one "
                    "(to_device does; else batch['lease'].release()) before fetching further"
                )
            fence, self._fence = self._fence, None
        if fence is not None:
            fence.synchronize()  # the copies out of this slot have completed


class SlotLease:
    """A recycled batch's hold on its ring slot (``SlotState``)."""

    def __init__(self, state: SlotState, lent: int) -> None:
        self._state, self._lent = state, lent

    def release(self, fence: Any = None) -> None:
        self._state.release(self._lent, fence)


def _with_views(
    buffers: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], list[tuple[str, memoryview, int]]]:
    views = [
        (name, memoryview(buf.numpy()).cast("B"), buf[0].numel() * buf.element_size())
        for name, buf in buffers.items()
    ]
    return buffers, views


def _pread_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(
                f"short read: {done} of {len(view)} bytes at offset {offset} (truncated shard?)"
            )
        done += got


class BatchStream:
    """Planned batches, in plan order, read ahead by ``num_workers`` threads.

    Threads, not processes: the reads are ``pread`` system calls that release the GIL, so
    they overlap the training step, and a batch needs no pickling or shared-memory copy to
    reach the trainer. With ``num_workers = 0`` each batch is read when asked for.

    ``recycle``: batch buffers come from a ring of ``ahead + 2`` slots. A batch then stays
    valid until two further batches have been fetched — true of a training loop, which
    finishes its step before fetching the next batch — and its slot is refilled only after
    its lease was released (``to_device``; ShardReader); a consumer that keeps batches
    (``list(stream)``) must leave ``recycle`` off.
    """

    def __init__(
        self,
        dataset: HiddenStateDataset,
        plan: list[BatchPlan],
        num_workers: int = 0,
        prefetch: int = 2,
        pin_memory: bool = False,
        recycle: bool = False,
        verify: str | None = None,
    ) -> None:
        self.dataset = dataset
        self.verify = verify
        self.plan = plan
        self.num_workers = num_workers
        self.ahead = num_workers * prefetch  # batches being read while one is in use
        self.recycle = recycle
        self.pin_memory = pin_memory

    def __len__(self) -> int:
        return len(self.plan)

    def __iter__(self) -> Iterator[Batch]:
        ring = self.ahead + 2 if self.recycle else 0
        capacity = max((sum(n for _, n in b) for b in self.plan), default=0)
        reader = ShardReader(
            self.dataset,
            ring=ring,
            capacity=capacity,
            pin_memory=self.pin_memory,
            verify=self.verify,
        )

        def slot(i: int) -> int | None:
            return i % ring if ring else None

        try:
            if self.num_workers == 0:
                for i, plan in enumerate(self.plan):
                    yield reader.read(plan, slot(i))
                return
            with ThreadPoolExecutor(self.num_workers, thread_name_prefix="eagle3-read") as pool:
                pending: deque[Future[Batch]] = deque()
                for i in range(min(self.ahead, len(self.plan))):
                    pending.append(pool.submit(reader.read, self.plan[i], slot(i)))
                following = len(pending)
                while pending:
                    batch = pending.popleft().result()
                    if following < len(self.plan):  # keep `ahead` reads in flight
                        pending.append(
                            pool.submit(reader.read, self.plan[following], slot(following))
                        )
                        following += 1
                    yield batch
        finally:
            reader.close()


# Batches of ``plan`` in order: BatchStream (ShardReader for ``verify``: None, "stop" or "skip").
make_loader = BatchStream


def to_device(batch: Batch, device: torch.device) -> dict[str, torch.Tensor]:
    """Model inputs on ``device``; fp8 storage is dequantized there (value = fp8 × scale).
    A recycled batch's slot is released here, fenced by an event after the copies on CUDA
    (the host may run steps ahead of them); on CPU the inputs are the buffers themselves,
    in use until the step ends, which the ring's two spare slots cover."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items() if torch.is_tensor(v)}
    lease = batch.get("lease")
    if lease is not None:
        fence = None
        if device.type == "cuda":
            fence = torch.cuda.Event()
            fence.record(torch.cuda.current_stream(device))
        lease.release(fence)
    # stored as int32 / uint8; widened on the device, not in the loader
    out["input_ids"] = out["input_ids"].long()
    out["loss_mask"] = out["loss_mask"].bool()
    if out["aux_hidden_states"].dtype == torch.float8_e4m3fn:
        out["aux_hidden_states"] = out["aux_hidden_states"].float() * out.pop(
            "aux_hidden_states_scale"
        ).unsqueeze(-1)
        out["last_hidden_state"] = out["last_hidden_state"].float() * out.pop(
            "last_hidden_state_scale"
        ).unsqueeze(-1)
    return out
