"""The project's KV connector for vLLM's ``extract_hidden_states`` path: states straight to shards.

vLLM's ``extract_hidden_states`` speculative method stores, for every prompt token, the
residual stream at the layer ids ``eagle_aux_hidden_state_layer_ids`` in the KV cache of a
cache-only layer (``[T, n_ids, H]`` per request). The stock ``ExampleHiddenStatesConnector``
copies a finished request's slots out with CUDA streams and pinned memory (so it fails on CPU)
and writes one file per request. This connector keeps the stock scheduler side and replaces the
worker side:

* request metadata (sample id, its place in the planned shard, loss mask, a digest of the token
  ids) rides in ``kv_transfer_params`` and is forwarded to the worker with the pending save;
* the slots are copied synchronously to host memory (works on any device);
* the worker checks every shape and the token ids against what the driver sent, and once all
  samples of a planned shard are in, packs them with the same writer as the transformers backend
  (``eagle3_extract.writer.write_shard``) on a background thread: shard + fragment, atomically.

Loaded by vLLM from ``kv_connector_module_path = "eagle3_extract.backends.connector"``.
Only tensor-parallel rank 0 writes (the stock connector's rule: the cache-only layer holds the
full states on every rank).
"""

from __future__ import annotations

import hashlib
import logging
import os
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)

from eagle3_extract.plan import ShardPlan, bytes_per_token
from eagle3_extract.samples import Sample
from eagle3_extract.writer import CapturedSample, CaptureError, check_room, write_shard
from eagle3_schemas.io.atomic import atomic_path
from eagle3_schemas.io.diskspace import DiskFull, disk_full, is_disk_full

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

CONNECTOR_NAME = "Eagle3ShardConnector"
MODULE_PATH = __name__
# Key of kv_transfer_params (per request) and of kv_connector_extra_config (per run).
PARAMS_KEY = "eagle3"
ERRORS_DIR = "errors"
# Name ending of an error record that is a full disk (the driver stops with exit 7).
DISK_FULL_SUFFIX = ".disk-full.txt"
RESERVE_BYTES = 64 << 10  # room kept to write that record on a disk that has none left


def ids_digest(token_ids: Any) -> str:
    """Digest of a token id sequence (int32 little-endian bytes); driver and worker agree."""
    return hashlib.blake2b(np.asarray(token_ids, dtype="<i4").tobytes(), digest_size=16).hexdigest()


def request_layer_ids(aux_layer_ids: list[int], num_layers: int) -> list[int]:
    """The ids to ask vLLM for: sorted and unique, because vLLM appends aux states in layer
    order as the forward passes each id (a list given out of order, or with N twice, would
    silently mislabel or broadcast them)."""
    return sorted({*aux_layer_ids, num_layers})


@dataclass
class Eagle3ConnectorMetadata(ExampleHiddenStatesConnectorMetadata):
    # req_id -> the eagle3 kv_transfer_params the driver attached to that request
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class _ShardBuffer:
    size: int
    items: dict[int, CapturedSample] = field(default_factory=dict)


class Eagle3ShardConnector(ExampleHiddenStatesConnector):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        run = self._kv_transfer_config.get_from_extra_config(PARAMS_KEY, None)
        if not isinstance(run, dict):
            raise ValueError(
                f"{CONNECTOR_NAME}: kv_connector_extra_config[{PARAMS_KEY!r}] must hold the run "
                f"settings (work_dir, storage_dtype, aux_layer_ids, ...), found {run!r}"
            )
        self._run = run
        self._work_dir = Path(run["work_dir"])
        self._fragments_dir = Path(run["fragments_dir"])
        self._aux = list(run["aux_layer_ids"])
        self._num_layers = int(run["num_hidden_layers"])
        self._hidden = int(run["hidden_size"])
        requested = request_layer_ids(self._aux, self._num_layers)
        configured = list(
            getattr(
                self._vllm_config.speculative_config.draft_model_config.hf_config,
                "eagle_aux_hidden_state_layer_ids",
                [],
            )
        )
        if configured != requested:
            raise ValueError(
                f"{CONNECTOR_NAME}: the engine captures layer ids {configured} but the run asks "
                f"for {requested}"
            )
        # Position of each wanted id (aux ids, then N) among the captured ones.
        self._select = [requested.index(i) for i in [*self._aux, self._num_layers]]
        self._n_captured = len(requested)
        # Scheduler side: req_id -> eagle3 params, until handed to the worker.
        self._sample_params: dict[str, dict[str, Any]] = {}
        # Worker side.
        self._buffers: dict[str, _ShardBuffer] = {}
        self._copied: set[str] = set()
        self._finished_seen: set[str] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eagle3-shard")
        self._writes: list[Future[Any]] = []
        self._per_token = bytes_per_token(len(self._aux), self._hidden, run["storage_dtype"])
        self._reserve = self._fragments_dir.parent / ERRORS_DIR / f"reserve-{os.getpid()}"
        self._reserve_room()

    # ---- scheduler side ------------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        if delay:
            eagle3 = (request.kv_transfer_params or {}).get(PARAMS_KEY)
            if not isinstance(eagle3, dict):
                raise ValueError(
                    f"{CONNECTOR_NAME}: request {request.request_id} carries no "
                    f"kv_transfer_params[{PARAMS_KEY!r}]; every request of an extraction run must"
                )
            self._sample_params[request.request_id] = eagle3
        return delay, params

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Eagle3ConnectorMetadata:
        base = super().build_connector_meta(scheduler_output)
        assert isinstance(base, ExampleHiddenStatesConnectorMetadata)
        meta = Eagle3ConnectorMetadata(
            pending_saves=base.pending_saves, new_req_filenames=base.new_req_filenames
        )
        for pending in meta.pending_saves:
            meta.samples[pending.req_id] = self._sample_params.pop(pending.req_id)
        return meta

    # ---- worker side ---------------------------------------------------------------------

    def wait_for_save(self) -> None:
        pass  # no lock files: the driver waits for shard fragments instead

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._raise_write_errors()
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, Eagle3ConnectorMetadata) and self._is_tp_rank_zero:
                for pending in meta.pending_saves:
                    try:
                        self._take(pending, meta.samples[pending.req_id])
                    except Exception as e:
                        self._record_error(meta.samples.get(pending.req_id, {}), e)
                        raise
                    self._copied.add(pending.req_id)
        # Blocks may be freed once the request is finished and its slots are copied out.
        self._finished_seen |= finished_req_ids
        done = self._copied & self._finished_seen
        self._copied -= done
        self._finished_seen -= done
        return done or None, None

    def _slots(self, pending: PendingSave) -> torch.Tensor:
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        return (blocks.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()

    def _take(self, pending: PendingSave, params: dict[str, Any]) -> None:
        assert self._kv_cache is not None, "register_kv_caches was not called"
        token_ids = pending.token_ids.reshape(-1).tolist()
        where = f"sample {params.get('sample_id')!r} (request {pending.req_id})"
        if ids_digest(token_ids) != params["ids_digest"] or len(token_ids) != params["num_tokens"]:
            raise CaptureError(
                f"{where}: the engine's prompt token ids ({len(token_ids)} tokens) differ from the "
                f"tokenized sample the driver sent ({params['num_tokens']} tokens)"
            )
        slots = self._slots(pending).to(self._kv_cache.device)
        states = extract_from_kv_cache(self._kv_cache, slots, len(token_ids)).to("cpu")
        expected = (len(token_ids), self._n_captured, self._hidden)
        if tuple(states.shape) != expected:
            raise CaptureError(
                f"{where}: the hidden-state cache returned shape {list(states.shape)}, expected "
                f"[T, n_ids, H] = {list(expected)}"
            )
        if "dry_run_path" in params:
            self._write_dry_run(Path(params["dry_run_path"]), states, token_ids)
            return
        sample = Sample(
            index=int(params["index"]),
            sample_id=str(params["sample_id"]),
            input_ids=np.asarray(token_ids, dtype=np.int32),
            loss_mask=np.frombuffer(bytes.fromhex(params["loss_mask"]), dtype=np.uint8).copy(),
        )
        if sample.loss_mask.shape[0] != sample.num_tokens:
            raise CaptureError(f"{where}: loss mask of {sample.loss_mask.shape[0]} tokens")
        buffer = self._buffers.setdefault(params["shard"], _ShardBuffer(int(params["shard_size"])))
        buffer.items[int(params["position"])] = CapturedSample(sample, states[:, self._select])
        if len(buffer.items) == buffer.size:
            del self._buffers[params["shard"]]
            captured = [buffer.items[i] for i in range(buffer.size)]
            plan = ShardPlan(params["shard"], tuple(c.sample for c in captured))
            self._writes.append(self._writer.submit(self._write, plan, captured))

    def _write(self, plan: ShardPlan, captured: list[CapturedSample]) -> None:
        try:
            check_room(self._work_dir, [plan], self._per_token)
            write_shard(
                self._work_dir,
                self._fragments_dir,
                plan,
                captured,
                n_aux=len(self._aux),
                hidden_size=self._hidden,
                storage_dtype=self._run["storage_dtype"],
            )
        except Exception as e:
            self._record_error({"shard": plan.name}, e)
            raise

    def _write_dry_run(self, path: Path, states: torch.Tensor, token_ids: list[int]) -> None:
        from safetensors.torch import save_file

        try:
            with atomic_path(path) as tmp:
                save_file(
                    {
                        "states": states.to(torch.float32).contiguous(),
                        "token_ids": torch.tensor(token_ids, dtype=torch.int32),
                    },
                    str(tmp),
                )
        except Exception as e:
            if not is_disk_full(e):
                raise
            raise disk_full(path.parent, "the dry-run capture", None, e) from e

    def _reserve_room(self) -> None:
        """A small file given back when the disk is full, so the error can still be written."""
        self._reserve.parent.mkdir(parents=True, exist_ok=True)
        self._reserve.write_bytes(b"\0" * RESERVE_BYTES)

    def _record_error(self, params: dict[str, Any], error: BaseException) -> None:
        """Leave the error where the driver looks while it waits (the engine may hide it); a
        full disk as its message alone, which the driver raises as ``DiskFull`` (exit 7)."""
        name = str(params.get("shard") or params.get("sample_id") or "unknown")
        errors = self._fragments_dir.parent / ERRORS_DIR
        errors.mkdir(parents=True, exist_ok=True)
        if isinstance(error, DiskFull):
            self._reserve.unlink(missing_ok=True)
            (errors / f"{name}{DISK_FULL_SUFFIX}").write_text(str(error), encoding="utf-8")
        else:
            text = "".join(traceback.format_exception(error))
            (errors / f"{name}.txt").write_text(text, encoding="utf-8")

    def _raise_write_errors(self) -> None:
        still = []
        for future in self._writes:
            if future.done():
                future.result()  # re-raises a failed write inside the engine: fail loudly
            else:
                still.append(future)
        self._writes = still

    def shutdown(self) -> None:
        self._writer.shutdown(wait=True)
        super().shutdown()
