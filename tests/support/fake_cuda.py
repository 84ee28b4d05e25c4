"""The trainer's CUDA path on a machine without a GPU: fake ``cuda:0`` tensors (the cuda_dry_run tier).

``torch._subclasses.fake_tensor.FakeTensorMode`` runs the ops of a training step on tensors that
carry a device, a dtype and a shape but no storage: ``cuda:0`` tensors need no GPU, the meta
kernels (bf16 GEMMs with ``out_dtype``, FlashAttention-2's forward and backward) check sizes,
and reading a value on the host (``.item()``, ``.tolist()``, ``bool()``) raises, as does an op
whose output shape depends on values (``nonzero``, boolean indexing). That makes it a checker
of exactly what the GPU step must not do (host syncs, dynamic shapes) and of what it must get
right (devices, dtypes, shapes), on every CI run. What it adds to the plain mode:

- ``StrictFakeCuda``: the real CUDA kernels' dtype rules the meta kernels lack (a GEMM's inputs
  of one dtype, ``out_dtype`` float32 or the inputs' own for fp16/bf16, FlashAttention's
  fp16/bf16 q/k/v and int32 ``cu_seqlens``), and, inside ``step()``, no blocking copy between
  host and device and no non-blocking one from pageable host memory. The checks sit in the
  fake mode's own dispatch (another TorchDispatchMode on top would make Dynamo skip compiling).
- ``backward``: the C++ autograd engine wants a CUDA context for any ``cuda`` tensor; this
  Python engine calls the graph's nodes in topological order instead (test_cuda_dry_run
  checks it against the C++ engine on real CPU tensors).
- ``fake_cuda()``: the answers torch asks a GPU for (autocast's availability, bf16 support,
  a GPU's properties (an H200's unless told), events, streams, memory counters), so the code takes its CUDA
  branches.
- ``inductor_for(gpu)``: train.compile's graphs lowered by Inductor for an H200, a B200 or an
  RTX PRO 6000 Blackwell, their Triton kernels compiled to that GPU's cubin by Triton's bundled ptxas (not loaded: that needs libcuda). ``torch.cuda.is_available`` stays False: patched, ``.to("cuda")`` would try a real
  copy.

What this tier can never show: numerics (there are no values), speed, memory use, the real
device's kernel limits (shared memory, registers, launch bounds), compiled *backward* graphs,
and NCCL collectives or ZeRO partitioning across ranks. Those need the lent GPU
(tools/gpu/gpu_check.py).

Pinned to the torch of uv.lock: the patches name private torch internals, so a different
torch fails ``check_torch_version`` (and a patched name that is gone fails naming the patch)
until this file is re-checked against it.
"""

from __future__ import annotations

import contextlib
import re
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

REPO = Path(__file__).resolve().parents[2]
aten = torch.ops.aten
DEVICE = torch.device("cuda:0")
HALF = (torch.float16, torch.bfloat16)


class FakeCudaViolation(AssertionError):
    """Something the real GPU step would refuse or stall on."""


class PatchBroken(RuntimeError):
    """A patched torch internal is gone or changed: the torch upgrade broke this patch."""


def locked_torch_version() -> str:
    """torch's version in uv.lock (the CUDA wheel the trainer runs with)."""
    text = (REPO / "uv.lock").read_text()
    found = re.search(r'\[\[package\]\]\nname = "torch"\nversion = "([^"]+)"', text)
    if found is None:
        raise PatchBroken("uv.lock names no torch package: support/fake_cuda.py cannot pin it")
    return found.group(1)


def check_torch_version() -> None:
    locked, installed = locked_torch_version(), torch.__version__
    if installed.split("+")[0] != locked.split("+")[0]:
        raise PatchBroken(
            f"support/fake_cuda.py is pinned to torch {locked} (uv.lock) and runs torch "
            f"{installed}: re-check each patch of fake_cuda() against it, then the tier"
        )


# --- the strict fake mode -------------------------------------------------------------------

_GEMMS = {
    aten.mm.default: (0, 1, None),
    aten.bmm.default: (0, 1, None),
    aten.addmm.default: (1, 2, 0),
    aten.baddbmm.default: (1, 2, 0),
}
_GEMMS_OUT_DTYPE = {
    aten.mm.dtype: (0, 1, None),
    aten.bmm.dtype: (0, 1, None),
    aten.addmm.dtype: (1, 2, 0),
    aten.baddbmm.dtype: (1, 2, 0),
}
_PIN = {aten._pin_memory.default}
_ROW_READS = {
    aten.index.Tensor,
    aten.index_select.default,
    aten.gather.default,
    aten.embedding.default,
}
_ROW_WRITES = {aten.index_put_.default, aten._index_put_impl_.default, aten.index_add_.default}
_FLASH_OPS = {
    f"{op}_{way}.default": way
    for op in ("aten._flash_attention", "eagle3.flash")
    for way in ("forward", "backward")
}


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


@dataclass
class Transfer:
    op: str
    source: str
    target: str
    non_blocking: bool
    pinned: bool
    stream: str = "default"  # the fake stream it was enqueued on (FakeStream.name)


@dataclass
class StepRecord:
    transfers: list[Transfer] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)  # aten op name -> calls
    # Counted only when the step is told the flash kernel's (query, key) pairs (``step(
    # causal_pairs=...)``: the kernel's varlen lengths are values, which fake tensors lack):
    # per (phase, op, GEMM operand sizes) the FLOPs and the bytes each op would move run
    # eagerly (it reads its inputs and writes its outputs once, a gather only the rows it
    # picks; a view moves nothing).
    causal_pairs: int | None = None
    phase: str = "forward"
    flops: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def count(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return  # a view
        if func.namespace == "prim" or "empty" in schema.name or not _leaves(out):
            return  # metadata, or memory allocated and not written
        written = [
            a
            for a, spec in zip(args, schema.arguments, strict=False)
            if spec.alias_info is not None and spec.alias_info.is_write
        ]
        fresh = [] if any(r.alias_info is not None for r in schema.returns) else _leaves(out)
        inputs = {id(t): t for t in _leaves((args, kwargs))}.values()
        indices = sum(_nbytes(t) for t in inputs if not t.is_floating_point())
        if func in _ROW_READS:  # a gather reads the rows it picks, not its whole source
            moved = indices + 2 * sum(map(_nbytes, fresh))
        elif func in _ROW_WRITES:  # a scatter reads its values and writes them into rows
            values = [t for t in _leaves(args[1:]) if t.is_floating_point()]
            moved = indices + 2 * sum(map(_nbytes, values))
        else:
            moved = sum(map(_nbytes, inputs)) + sum(map(_nbytes, _leaves([written, fresh])))
        flash = _FLASH_OPS.get(str(func))  # the kernel's, or ours around it (eagle3::flash_*)
        gemm = func._overloadpacket in flop_registry and not flash
        if func in (aten._to_copy.default, aten.copy_.default):
            source, target = (args[0], out) if func is aten._to_copy.default else args[1::-1]
            if source.device != target.device:
                self.bytes[(self.phase, str(func), ("h2d",))] += _nbytes(source)
                return
        dims = tuple(sorted({d for t in _leaves(args) for d in t.shape})) if gemm else ()
        key = (self.phase, str(func), dims)
        self.bytes[key] += moved
        if flash:  # document-causal: 2 FLOPs per (pair, head, width) in QK^T and in PV
            q, v = (args[0], args[2]) if flash == "forward" else (args[1], args[3])
            forward = 2 * q.shape[1] * (q.shape[2] + v.shape[2]) * self.causal_pairs
            self.flops[key] += forward if flash == "forward" else 2 * forward
        elif gemm:
            self.flops[key] += flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """The bytes a kernel reads or writes of ``t``: a broadcast (stride 0) dimension once."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        n *= size if stride else 1
    return n


class StrictFakeCuda(FakeTensorMode):
    """FakeTensorMode plus the real CUDA kernels' dtype rules and the step's transfer rules."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=False)
        self.pinned: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.record: StepRecord | None = None  # set inside step()
        self.depth = 0

    @contextlib.contextmanager
    def step(self, causal_pairs: int | None = None) -> Iterator[StepRecord]:
        """The region of one training step: host syncs and host↔device stalls fail here. With
        ``causal_pairs``, its FLOPs and bytes are counted (StepRecord)."""
        self.record = StepRecord(causal_pairs=causal_pairs)
        try:
            yield self.record
        except DataDependentOutputException as e:
            raise FakeCudaViolation(
                f"host sync inside the step: {e} (a value read on the host)"
            ) from e
        except DynamicOutputShapeException as e:
            raise FakeCudaViolation(f"data-dependent shape inside the step: {e}") from e
        finally:
            self.record = None

    def dispatch(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        self._check(func, args, kwargs)
        if func is aten.is_pinned.default:
            return args[0] in self.pinned
        if func in _PIN:  # page-locked host memory: a copy of the host tensor (no fake kernel)
            out = super().dispatch(aten.clone.default, types, (args[0],), {})
            self.pinned[out] = True
            return out
        self.depth += 1  # a decomposition's ops come back through here: count the outermost
        try:
            out = super().dispatch(func, types, args, kwargs)
        finally:
            self.depth -= 1
        if self.depth == 0 and self.record is not None and self.record.causal_pairs is not None:
            self.record.count(func, args, kwargs, out)
        if func in (aten.empty.memory_format, aten.empty_strided.default) and kwargs.get(
            "pin_memory"
        ):
            self.pinned[out] = True
        return out

    def _check(self, func, args: tuple, kwargs: dict) -> None:
        if self.record is not None:
            self.record.ops[str(func)] += 1
        if func in _GEMMS:
            a_i, b_i, self_i = _GEMMS[func]
            a, b = args[a_i], args[b_i]
            dtypes = {a.dtype, b.dtype} | ({args[self_i].dtype} if self_i is not None else set())
            if len(dtypes) > 1:
                raise FakeCudaViolation(
                    f"{func}: operands of dtypes {sorted(map(str, dtypes))}; the CUDA kernel "
                    "expects one dtype (mat1 and mat2 must have the same dtype)"
                )
        elif func in _GEMMS_OUT_DTYPE:
            a_i, b_i, self_i = _GEMMS_OUT_DTYPE[func]
            a, b = args[a_i], args[b_i]
            out_dtype = _arg(args, kwargs, b_i + 1, "out_dtype")
            if a.dtype != b.dtype:
                raise FakeCudaViolation(f"{func}: mat1 {a.dtype} and mat2 {b.dtype} differ")
            if not (out_dtype == a.dtype or (out_dtype == torch.float32 and a.dtype in HALF)):
                raise FakeCudaViolation(
                    f"{func}: out_dtype {out_dtype} for {a.dtype} inputs; CUDA takes the "
                    "inputs' dtype, or float32 for float16/bfloat16 inputs"
                )
            if self_i is not None and args[self_i].dtype not in (out_dtype, a.dtype):
                raise FakeCudaViolation(
                    f"{func}: self {args[self_i].dtype} is neither out_dtype {out_dtype} "
                    f"nor the inputs' {a.dtype}"
                )
        elif func is aten._flash_attention_forward.default:
            self._check_flash(func, dict(zip(("q", "k", "v"), args[:3], strict=True)), args[3:5])
        elif func is aten._flash_attention_backward.default:
            tensors = dict(zip(("grad_out", "q", "k", "v", "out"), args[:5], strict=True))
            if args[5].dtype != torch.float32:
                raise FakeCudaViolation(f"{func}: logsumexp {args[5].dtype}, expected float32")
            self._check_flash(func, tensors, args[6:8])
        elif func in (aten._to_copy.default, aten.copy_.default):
            self._check_transfer(func, args, kwargs)

    def _check_flash(self, func, tensors: dict[str, Any], cu_seqlens: tuple) -> None:
        dtypes = {n: t.dtype for n, t in tensors.items()}
        if len(set(dtypes.values())) > 1 or next(iter(dtypes.values())) not in HALF:
            raise FakeCudaViolation(
                f"{func}: {dtypes}; FlashAttention takes float16 or bfloat16, all alike"
            )
        for name, t in zip(("cum_seq_q", "cum_seq_k"), cu_seqlens, strict=True):
            if t is not None and t.dtype != torch.int32:
                raise FakeCudaViolation(f"{func}: {name} is {t.dtype}; the CUDA kernel takes int32")
        for name, t in tensors.items():
            if t.device.type != "cuda":
                raise FakeCudaViolation(f"{func}: {name} on {t.device}")

    def _check_transfer(self, func, args: tuple, kwargs: dict) -> None:
        if func is aten._to_copy.default:
            src, dst = args[0], kwargs.get("device") or args[0].device
            host = src
        else:
            dst_t, src = args[0], args[1]
            dst = dst_t.device
            host = dst_t if dst_t.device.type == "cpu" else src
        source, target = src.device.type, torch.device(dst).type
        if source == target:
            return
        non_blocking = bool(_arg(args, kwargs, 2, "non_blocking", False))
        if func is aten._to_copy.default:
            non_blocking = bool(kwargs.get("non_blocking", False))
        pinned = host in self.pinned
        if self.record is None:
            return
        stream = FakeStream.current.name
        self.record.transfers.append(
            Transfer(str(func), source, target, non_blocking, pinned, stream)
        )
        if not non_blocking:
            raise FakeCudaViolation(
                f"{func}: a blocking {source} -> {target} copy inside the step (a host sync; "
                "a tensor made on the host and moved, or a value read back)"
            )
        if not pinned:
            raise FakeCudaViolation(
                f"{func}: a non-blocking {source} -> {target} copy from pageable host memory "
                "inside the step (the host waits for it anyway)"
            )


# --- the Python autograd engine ---------------------------------------------------------------


def _topological(root: Any) -> list[Any]:
    order, seen = [], set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                stack.append((child, False))
    return order[::-1]  # every node before the nodes it feeds gradients to


def backward(loss: torch.Tensor) -> int:
    """``loss.backward()`` without the C++ engine (which needs a CUDA context for cuda
    tensors): each node of ``loss``'s graph called once, in topological order, with the sum of
    its incoming gradients; leaves' ``.grad`` accumulated. Returns the number of nodes run."""
    if loss.grad_fn is None:
        raise ValueError("backward: the loss has no graph")
    grads: dict[Any, list[torch.Tensor | None]] = {loss.grad_fn: [torch.ones_like(loss)]}
    ran = 0
    for node in _topological(loss.grad_fn):
        incoming = grads.pop(node, None)
        if incoming is None or all(g is None for g in incoming):
            continue
        ran += 1
        if hasattr(node, "variable"):  # AccumulateGrad: a leaf
            (g,) = incoming
            var = node.variable
            var.grad = g.detach() if var.grad is None else var.grad + g
            continue
        if hasattr(node, "apply"):  # a Python autograd.Function: its gradients materialised
            incoming = [  # (None -> zeros), as the C++ engine does by default
                torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
                for g, m in zip(incoming, node._input_metadata, strict=True)
            ]
            outputs = node.apply(*incoming)
            if not isinstance(outputs, tuple):
                outputs = (outputs,)
            # one result per forward argument; next_functions has one per tensor argument
            # (None for those without a gradient): pair the ones that need a gradient
            outputs = [g for g, need in zip(outputs, node.needs_input_grad, strict=False) if need]
            edges = [edge for edge in node.next_functions if edge[0] is not None]
        else:
            outputs = node(*incoming)
            if not isinstance(outputs, tuple):
                outputs = (outputs,)
            edges = list(node.next_functions)
        for (child, slot), g in zip(edges, outputs, strict=True):
            if child is None or g is None:
                continue
            meta = child._input_metadata[slot]
            # the C++ engine's validate_outputs: broadcast gradients summed to the input's
            # shape, cast to its dtype (a float32 gradient of a bf16 input arrives as bf16)
            if tuple(g.shape) != tuple(meta.shape):
                g = g.sum_to_size(meta.shape)
            if g.dtype != meta.dtype:
                g = g.to(meta.dtype)
            if g.device != meta.device:
                raise FakeCudaViolation(
                    f"backward: {node.name()} gives a gradient on {g.device} for an input on "
                    f"{meta.device}"
                )
            slots = grads.setdefault(child, [None] * max(1, len(child._input_metadata)))
            slots[slot] = g if slots[slot] is None else slots[slot] + g
    return ran


# --- the answers torch asks a GPU for --------------------------------------------------------

H200 = SimpleNamespace(
    name="NVIDIA H200 (fake)",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=141 * 2**30,
    warp_size=32,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    regs_per_multiprocessor=65536,
    shared_memory_per_block_optin=232448,
    shared_memory_per_multiprocessor=233472,
    L2_cache_size=60 * 2**20,
    gcnArchName="",
    uuid="fake",
    is_integrated=False,
)
# Blackwell, the kinds the project's users train on beside Hopper (the properties Inductor's
# heuristics read: SMs, shared memory, threads, L2), from NVIDIA's published specifications
B200 = SimpleNamespace(
    **{
        **vars(H200),
        "name": "NVIDIA B200 (fake)",
        "major": 10,
        "minor": 0,
        "multi_processor_count": 148,
        "total_memory": 179 * 2**30,
        "L2_cache_size": 126 * 2**20,
    }
)
RTX_PRO_6000 = SimpleNamespace(
    **{
        **vars(H200),
        "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition (fake)",
        "major": 12,
        "minor": 0,
        "multi_processor_count": 188,
        "total_memory": 95 * 2**30,
        "max_threads_per_multi_processor": 1536,
        "shared_memory_per_block_optin": 101376,
        "shared_memory_per_multiprocessor": 102400,
        "L2_cache_size": 128 * 2**20,
    }
)
T4 = SimpleNamespace(  # Turing: below every kernel's floor but the reference's
    **{
        **vars(H200),
        "name": "NVIDIA T4 (fake)",
        "major": 7,
        "minor": 5,
        "multi_processor_count": 40,
        "total_memory": 15 * 2**30,
        "max_threads_per_multi_processor": 1024,
        "shared_memory_per_block_optin": 65536,
        "shared_memory_per_multiprocessor": 65536,
        "L2_cache_size": 4 * 2**20,
    }
)
GPUS = {"sm_90": H200, "sm_100": B200, "sm_120": RTX_PRO_6000}  # what the step is compiled for


def sm(gpu: SimpleNamespace) -> int:
    """The compute capability as one number (9.0 → 90), as Triton's targets name it."""
    return gpu.major * 10 + gpu.minor


class FakeEvent:
    """torch.cuda.Event: record/synchronize/query without a device (there is nothing to wait on);
    it remembers the stream it was recorded on."""

    recorded: ClassVar[list[FakeEvent]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.is_recorded = False
        self.synchronized = False
        self.stream: FakeStream | None = None

    def record(self, stream: Any = None) -> None:
        self.is_recorded = True
        self.stream = stream or FakeStream.current
        FakeEvent.recorded.append(self)

    def synchronize(self) -> None:
        self.synchronized = True

    def wait(self, stream: Any = None) -> None:
        (stream or FakeStream.current).wait_event(self)

    def query(self) -> bool:
        return True


class FakeStream:
    """torch.cuda.Stream: a name, and the waits on events it was told of (``waits``, in order,
    across streams). ``current``: the stream work is enqueued on (``torch.cuda.stream``)."""

    current: ClassVar[FakeStream]
    waits: ClassVar[list[tuple[str, FakeEvent]]] = []  # (waiting stream, event)
    uses: ClassVar[list[tuple[str, torch.Tensor]]] = []  # Tensor.record_stream: (stream, tensor)
    made: ClassVar[int] = 0

    def __init__(self, device: Any = None, *args: Any, name: str = "", **kwargs: Any) -> None:
        self.device = torch.device(device or DEVICE)
        if not name:
            FakeStream.made += 1
            name = f"side-{FakeStream.made}"
        self.name = name

    def wait_stream(self, other: Any) -> None:
        self.wait_event(other.record_event())

    def wait_event(self, event: Any) -> None:
        FakeStream.waits.append((self.name, event))

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> FakeEvent:
        event = event or FakeEvent()
        event.record(self)
        return event


DEFAULT_STREAM = FakeStream.current = FakeStream(name="default")


def _record_stream(tensor: torch.Tensor, stream: FakeStream) -> None:
    """Tensor.record_stream: the tensor's memory is in use by ``stream`` too."""
    FakeStream.uses.append((stream.name, tensor))


@contextlib.contextmanager
def _on_stream(stream: FakeStream | None) -> Iterator[None]:
    """torch.cuda.stream: work inside is enqueued on ``stream``."""
    before = FakeStream.current
    FakeStream.current = stream or before
    try:
        yield
    finally:
        FakeStream.current = before


@dataclass
class Memory:
    """What torch.cuda's memory counters answer (tests read ``resets`` and ``queries``)."""

    free: int = 120 * 2**30
    total: int = 141 * 2**30
    peak: int = 3 * 2**30
    resets: int = 0
    queries: int = 0


def _patch(stack: contextlib.ExitStack, owner: Any, name: str, value: Any, label: str) -> None:
    if not hasattr(owner, name):
        raise PatchBroken(
            f"fake_cuda patch {label!r}: {getattr(owner, '__name__', owner)}.{name} is gone in "
            f"torch {torch.__version__}"
        )
    if isinstance(owner, type) and name not in vars(owner):  # inherited: patch, then drop
        setattr(owner, name, value)
        stack.callback(delattr, owner, name)
        return
    # a class's own attribute as stored (a staticmethod stays one when restored)
    saved = vars(owner)[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    stack.callback(setattr, owner, name, saved)


@contextlib.contextmanager
def fake_cuda(
    memory: Memory | None = None, gpu: SimpleNamespace = H200
) -> Iterator[StrictFakeCuda]:
    """The strict fake mode on, with torch.cuda answering as one ``gpu`` (an H200: sm_90)."""
    check_torch_version()
    memory = memory or Memory()
    mode = StrictFakeCuda()
    cuda = torch.cuda

    def reset_peak(device: Any = None) -> None:
        memory.resets += 1

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        memory.queries += 1
        return memory.free, memory.total

    with contextlib.ExitStack() as stack:
        patches = [
            # autocast("cuda") disables itself without these ("CUDA is not available")
            (cuda.amp.common, "amp_definitely_not_available", lambda: False, "autocast on"),
            (cuda, "is_bf16_supported", lambda *a, **k: True, "bf16 supported"),
            (cuda, "get_device_properties", lambda *a, **k: gpu, "the GPU's properties"),
            (cuda, "get_device_capability", lambda *a, **k: (gpu.major, gpu.minor), "capability"),
            (cuda, "current_device", lambda: 0, "current device"),
            (cuda, "Event", FakeEvent, "events"),
            (cuda, "Stream", FakeStream, "streams"),
            (cuda, "current_stream", lambda *a, **k: FakeStream.current, "current stream"),
            (cuda, "default_stream", lambda *a, **k: DEFAULT_STREAM, "default stream"),
            (cuda, "stream", _on_stream, "stream context"),
            (torch.Tensor, "record_stream", _record_stream, "record_stream"),
            (cuda, "synchronize", lambda *a, **k: None, "synchronize"),
            (cuda, "set_sync_debug_mode", lambda *a, **k: None, "sync debug mode"),
            (cuda, "get_sync_debug_mode", lambda *a, **k: 0, "sync debug mode"),
            (cuda, "mem_get_info", mem_get_info, "memory info"),
            (cuda, "reset_peak_memory_stats", reset_peak, "peak memory reset"),
            (cuda, "max_memory_allocated", lambda *a, **k: memory.peak, "peak memory"),
            (cuda, "memory_allocated", lambda *a, **k: memory.peak // 2, "memory allocated"),
            (cuda, "empty_cache", lambda: None, "empty cache"),
        ]
        for owner, name, value, label in patches:
            _patch(stack, owner, name, value, label)
        FakeEvent.recorded = []
        FakeStream.waits, FakeStream.uses = [], []
        FakeStream.current = DEFAULT_STREAM
        stack.enter_context(mode)
        yield mode


def fake_host(mode: StrictFakeCuda, tensor: torch.Tensor, pinned: bool = False) -> torch.Tensor:
    """A real host tensor as a fake one (page-locked with ``pinned``)."""
    fake = mode.from_tensor(tensor)
    if pinned:
        mode.pinned[fake] = True
    return fake


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Real tensors again for a while (host-side work on real values, e.g. shift.align)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


# --- Inductor targeting a GPU (sm_90, sm_100, sm_120) ---------------------------------------


@dataclass
class InductorRun:
    """What Inductor made of each graph Dynamo handed it: the Triton kernels it generated and
    compiled (PTX and cubin for the target GPU, through Triton's bundled ptxas), per graph."""

    graphs: list[torch.fx.GraphModule] = field(default_factory=list)
    kernels: list[list[str]] = field(default_factory=list)  # per graph: Triton kernel names
    binaries: list[list[dict[str, Any]]] = field(default_factory=list)  # per graph: metadata


def cubin_sm(cubin: bytes) -> int:
    """The SM a cubin was built for, from its ELF header's ``e_flags``, as Triton 3.8's ptxas
    (CUDA 12.9) writes them: ELF ABI version 7 (up to sm_90) holds the SM in the low byte
    (0x5a for sm_90), version 8 (sm_100 on) in the next one (0x0600640a for sm_100a, 0x0600780a
    for sm_120a)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        raise ValueError(f"not a 64-bit ELF cubin: {cubin[:8]!r}")
    (e_flags,) = struct.unpack_from("<I", cubin, 48)
    abi = cubin[8]
    if abi not in (7, 8):
        raise ValueError(f"cubin of ELF ABI version {abi}: cubin_sm reads versions 7 and 8")
    return (e_flags >> (8 if abi == 8 else 0)) & 0xFF


@contextlib.contextmanager
def inductor_for(gpu: SimpleNamespace = H200) -> Iterator[InductorRun]:
    """train.compile's graphs through Inductor as on ``gpu``, inside ``fake_cuda(gpu=gpu)``.

    Inductor lowers each graph, generates Triton kernels for cuda:0 and compiles them to PTX
    and cubin for the forward graph (as for inference) (Triton's ``GPUTarget("cuda", sm, 32)``,
    90 for an H200, 100 for a B200, 120 for an RTX PRO 6000; ptxas runs). Only the last step needs a
    GPU: loading the cubin (``CachingAutotuner._make_launchers`` → ``cuModuleLoadData``, via
    ``torch.cuda._lazy_init``: "Found no NVIDIA driver on your system"). So the kernels are not
    loaded, and each graph then runs as Dynamo captured it, on the fake tensors. The backward
    graphs are not produced: AOTAutograd's joint trace runs the C++ autograd engine, which
    wants a CUDA context ("hasPrimaryContext expects a valid device index, but got
    device_index=0"), so each graph is lowered from detached inputs under ``no_grad``.

    What it answers for a GPU, each needed measured on torch 2.14 / triton 3.8:
    - Dynamo's ``CudaInterface`` (bound to torch.cuda's functions at import): available,
      the GPU's properties, bf16 supported, device 0 — else ``has_triton()`` is false
      ("Cannot find a working triton installation") and lowering calls the real driver;
    - Triton's active driver: a ``CudaDriver`` answering ``GPUTarget("cuda", sm, 32)``,
      ``CudaDriver.is_active`` true (Inductor's ``set_driver_to_gpu``: "Could not find an
      active GPU backend");
    - Inductor config: ``shape_padding`` off (pad_mm benchmarks on the device),
      ``joint_graph_constant_folding`` off (it evaluates the graph's constant ops outside the
      fake mode, on the device: the flash path's ``logsumexp`` makes a ``scalar_tensor`` on
      cuda:0), ``compile_threads`` 1 (no worker processes), no FX graph cache (each run
      compiles).
    """
    import torch._inductor.compile_fx as compile_fx
    import torch.utils._triton as torch_triton
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor import config as inductor_config
    from torch._inductor.runtime.hints import DeviceProperties
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    class GpuDriver(CudaDriver):
        """Triton's CUDA driver as far as code generation asks it (no libcuda)."""

        def __init__(self) -> None:  # the real one loads libcuda's utilities
            pass

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", sm(gpu), 32)

        def get_active_torch_device(self) -> torch.device:
            return DEVICE

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: Any = None) -> int:
            return 0

        def get_device_interface(self) -> Any:
            return torch.cuda

    run = InductorRun()
    current: list[tuple[str, dict[str, Any]]] = []

    def no_load(self: CachingAutotuner) -> None:  # the kernels compiled; loading needs a GPU
        for result in self.compile_results:
            kernel = result.kernel  # a Triton CompiledKernel, or Inductor's static launcher
            cubin = getattr(kernel, "cubin_raw", None) or getattr(kernel, "asm", {}).get("cubin")
            current.append(
                (
                    self.fn.__name__,
                    {
                        "target": result.compile_meta.get("cc"),
                        "sm": cubin_sm(cubin) if cubin else None,
                        "cubin": cubin,
                    },
                )
            )

    real_compile_fx = compile_fx.compile_fx

    def generate(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        current.clear()
        # the forward graph, as for inference: AOTAutograd's joint forward-backward trace
        # runs the C++ autograd engine, which wants a CUDA context ("hasPrimaryContext expects
        # a valid device index"), so the backward graphs are not lowered
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            inputs = [  # (a float input's wrapping 0-d tensor kept: it carries its symbol)
                x.detach() if isinstance(x, torch.Tensor) and x.requires_grad else x
                for x in example_inputs
            ]
        with torch.no_grad():
            real_compile_fx(gm, inputs, **kwargs)
        run.graphs.append(gm)
        run.kernels.append(sorted({name for name, _ in current}))
        run.binaries.append([info for _, info in current])
        return gm.forward  # run as captured: the compiled module's kernels are not loaded

    def static(value: Any) -> staticmethod:
        return staticmethod(value)

    with contextlib.ExitStack() as stack:
        patches = [
            (CudaInterface, "is_available", static(lambda: True), "inductor: cuda available"),
            (
                CudaInterface,
                "get_device_properties",
                static(lambda *a, **k: gpu),
                "inductor: the GPU's properties",
            ),
            (CudaInterface, "is_bf16_supported", static(lambda *a, **k: True), "inductor: bf16"),
            (CudaInterface, "current_device", static(lambda: 0), "inductor: device 0"),
            (CudaInterface, "synchronize", static(lambda *a, **k: None), "inductor: synchronize"),
            (CudaInterface, "get_raw_stream", static(lambda *a: 0), "inductor: raw stream"),
            (
                CudaInterface.Worker,
                "get_device_properties",
                static(lambda *a, **k: gpu),
                "inductor: worker's GPU properties",
            ),
            (CudaInterface.Worker, "current_device", static(lambda: 0), "inductor: worker device"),
            (CudaDriver, "is_active", static(lambda: True), "triton: CUDA driver active"),
            (CachingAutotuner, "_make_launchers", no_load, "inductor: kernels not loaded"),
            (CachingAutotuner, "_dynamic_scale_rblock", lambda self: None, "inductor: no rblock"),
            (compile_fx, "compile_fx", generate, "inductor: graphs run as captured"),
        ]
        for owner, name, value, label in patches:
            _patch(stack, owner, name, value, label)
        stack.enter_context(
            inductor_config.patch(
                shape_padding=False,
                joint_graph_constant_folding=False,
                compile_threads=1,
                fx_graph_cache=False,
            )
        )
        stack.callback(setattr, driver, "_active", driver._active)
        driver.set_active(GpuDriver())
        # Inductor keeps each device's properties for the process: another GPU's are dropped
        DeviceProperties.create.cache_clear()
        stack.callback(DeviceProperties.create.cache_clear)
        for cached in (torch_triton.has_triton, torch_triton.triton_backend):
            cached.cache_clear()
            stack.callback(cached.cache_clear)
        yield run
