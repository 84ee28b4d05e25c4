"""The trainer's CUDA path, run on fake ``cuda:0`` tensors on a machine without a GPU (issue 44).

One training step of the trainer's own code (``data.batch.forward``: the host-side alignment, the
batch and alignment moved non-blocking from pinned memory, bf16 autocast, the flash TTT
attention; then backward, the optimizer) runs under ``support.fake_cuda``: fake tensors that
carry device, dtype and shape, the real CUDA kernels' dtype rules, no host sync and no blocking
copy inside the step. With train.compile, each graph Dynamo captures is lowered by Inductor
for an H200 and its Triton kernels compiled to sm_90 cubin (support/fake_cuda.inductor_for;
not loaded, and forward graphs only). The accelerator's and the loop's CUDA branches run too.
What it can never show (numerics, speed, memory, kernel limits, compiled
backward graphs, NCCL/ZeRO): support/fake_cuda.py's docstring.

    uv run pytest -m cuda_dry_run tests/test_cuda_dry_run.py
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from eagle3_train.components.build import make_optimizer
from eagle3_train.components.preempt import Preemption
from eagle3_train.config.run_config import Config
from eagle3_train.data import batch as batch_module
from eagle3_train.data.loader import SlotState
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.shift import align
from eagle3_train.preflight.device import check_memory
from eagle3_train.run.nonfinite import BadStep, NonFiniteSkip

from support import fake_cuda as fc
from support.fake_step import (
    LENGTHS,
    TTT,
    Accelerator,
    host_batch,
    make_model,
    real_align,
    train_step,
)
from support.train import small_arch, yarn_arch

pytestmark = pytest.mark.cuda_dry_run


@pytest.fixture
def step_config(monkeypatch) -> Config:
    monkeypatch.setattr(batch_module, "align", real_align)
    config = Config()
    config.train.ttt_steps = TTT
    config.train.compile = "never"
    return config


def assert_trained(model, record, flash: bool = True) -> None:
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    missing = [n for n, g in grads.items() if g is None]
    assert not missing, f"no gradient: {missing}"
    wrong = {
        n: (g.dtype, str(g.device))
        for n, g in grads.items()
        if (g.dtype, g.device) != (torch.float32, fc.DEVICE)
    }
    assert not wrong, f"gradients not float32 on cuda:0: {wrong}"
    ops = record.ops
    if flash:
        assert ops["aten._flash_attention_forward.default"] > 0, "the flash path did not run"
        assert ops["aten._flash_attention_backward.default"] > 0
    assert ops["aten.mm.dtype"] + ops["aten.bmm.dtype"] > 0, "no bf16 GEMM with float32 result"
    blocking = [t for t in record.transfers if not t.non_blocking]
    assert not blocking


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_llama_step_bf16_flash(step_config, recompute) -> None:
    step_config.train.recompute = recompute
    accelerator = Accelerator()
    with fc.fake_cuda() as mode:
        model = make_model(small_arch(num_layers=2), step_config, accelerator)
        assert model.embed_tokens.dtype == torch.bfloat16  # speed_up under bf16
        loss, stats, record = train_step(mode, model, step_config, accelerator)
        assert (loss.dtype, loss.device) == (torch.float32, fc.DEVICE)
        assert stats.shape == (TTT, 5) and stats.dtype == torch.float64
        assert_trained(model, record)
        assert {(t.source, t.target) for t in record.transfers} == {("cpu", "cuda")}


def test_mla_step_bf16_flash(step_config) -> None:
    accelerator = Accelerator()
    with fc.fake_cuda() as mode:
        model = make_model(yarn_arch("mla"), step_config, accelerator)
        _, _, record = train_step(mode, model, step_config, accelerator)
        assert_trained(model, record)


def test_fused_adamw_skips_with_found_inf_on_the_device(step_config) -> None:
    """train.on_non_finite: skip with torch's fused AdamW: the verdict reaches the kernel as
    ``found_inf`` on the device, no host read; the step's gradients are float32 on cuda:0."""
    accelerator = Accelerator(processes=2)
    with fc.fake_cuda() as mode:
        model = make_model(small_arch(), step_config, accelerator)
        optimizer = make_optimizer(model, step_config, accelerator)
        assert all(g["fused"] for g in optimizer.param_groups)
        watch = NonFiniteSkip(accelerator, lag=2, max_in_row=3)
        batch = host_batch(mode, 16, 40)
        with mode.step() as record:
            loss, _ = batch_module.forward(model, batch, accelerator, step_config)
            watch.record(loss, BadStep("loss", loss.detach(), 1, 0, 0, [0]), None, None)
            fc.backward(loss)
            watch.step_optimizer(optimizer)
            watch.end_step(None, None)  # the verdict queued: pinned copy + event, read lag later
        assert record.ops["aten._fused_adamw_.default"] == 2  # decay and no-decay groups
        assert not hasattr(optimizer, "found_inf")
        ((host, event, _),) = watch.pending
        assert host.device.type == "cpu" and host in mode.pinned and event.is_recorded
        assert not event.synchronized


@pytest.mark.parametrize(
    "which",
    [
        "torch",
        "deepspeed",
    ],
)
def test_muon_step(step_config, which) -> None:
    """train.optimizer: muon — torch's Muon + fused AdamW, or DeepSpeed's MuonWithAuxAdam (its
    ZeRO-2 partitioning is not run here: one process, no NCCL)."""
    step_config.train.optimizer = "muon"
    accelerator = Accelerator()
    if which == "deepspeed":
        from eagle3_train.components.build import make_deepspeed_muon

        def optimizer_of(model):
            return make_deepspeed_muon(model, step_config, fused=True)
    else:

        def optimizer_of(model):
            return make_optimizer(model, step_config, accelerator)

    torch._dynamo.reset()
    with fc.fake_cuda() as mode, fc.inductor_for() as run:
        model = make_model(small_arch(), step_config, accelerator)
        optimizer = optimizer_of(model)
        _, _, record = train_step(mode, model, step_config, accelerator, optimizer)
        assert record.ops["aten._fused_adamw_.default"] == 1
        assert record.ops["aten.mm.default"] > 0  # Newton–Schulz
        for p in model.parameters():
            assert p.device == fc.DEVICE and p.dtype == torch.float32
    torch._dynamo.reset()
    if which == "deepspeed":  # its Newton–Schulz is torch.compile'd: lowered for sm_90
        assert run.graphs and all(run.kernels), run.kernels
        assert {(b["target"], b["sm"]) for per_graph in run.binaries for b in per_graph} == {
            (90, 90)
        }


def test_next_batch_is_copied_on_a_side_stream_one_step_ahead(step_config) -> None:
    """data.batch.ahead_to_device on CUDA: when a batch is handed to its step, the next one's
    copies are already enqueued, on a side stream (none on the stream that computes); the step
    makes the compute stream wait on the event recorded after them (the host does not wait),
    marks every staged tensor as used by the compute stream (the caching allocator keeps its
    memory until the step is done), and the ring slot's fence follows the copies."""
    accelerator = Accelerator()
    with fc.fake_cuda() as mode:
        model = make_model(small_arch(), step_config, accelerator)
        slots = [SlotState(), SlotState(), SlotState()]
        batches = []
        for slot in slots:
            batch = host_batch(mode, 16, 40)
            batch["lease"] = slot.lend()
            batches.append(batch)
        with mode.step() as record:
            ahead = batch_module.ahead_to_device(iter(batches), fc.DEVICE, TTT)
            first = next(ahead)
            assert first is batches[0]
            copies = [t for t in record.transfers if (t.source, t.target) == ("cpu", "cuda")]
            per_batch = len(copies) // 2
            assert per_batch > 0 and len(copies) == 2 * per_batch  # this batch's and the next's
            side = {t.stream for t in copies}
            assert len(side) == 1 and side != {"default"}, side
            loss, _ = batch_module.forward(model, first, accelerator, step_config)
            fc.backward(loss)
            assert next(ahead) is batches[1]
            assert len(record.transfers) == 3 * per_batch  # the third's, one step ahead again
        assert not [t for t in record.transfers if not (t.non_blocking and t.pinned)]
        ((waiting, event),) = fc.FakeStream.waits  # the one step taken
        assert waiting == "default" and event.stream.name in side
        staged = first["staged"]
        used = {id(x) for stream, x in fc.FakeStream.uses if stream == "default"}
        assert used == {id(x) for x in staged._tensors()}
        for slot in slots:
            assert slot._fence.is_recorded and slot._fence.stream.name in side
            assert not slot._fence.synchronized


def test_preempt_vote_reads_back_without_a_host_sync() -> None:
    """Two ranks vote every optimizer step; the vote is made on the device and read back
    ``lag`` steps later through a pinned buffer and an event (no host sync in the step)."""
    accelerator = Accelerator(processes=2)
    preempt = Preemption(["SIGTERM"], accelerator, lag=2)
    with fc.fake_cuda() as mode:
        with mode.step() as record:
            assert preempt.poll() is False
            assert preempt.poll() is False
        assert all(t.non_blocking and t.pinned for t in record.transfers)
        assert [(t.source, t.target) for t in record.transfers] == [("cuda", "cpu")] * 2
        assert all(e.is_recorded and not e.synchronized for e in fc.FakeEvent.recorded)


def test_python_engine_matches_the_cpp_engine() -> None:
    """fc.backward (the engine the fake device needs) against loss.backward() on real CPU
    tensors: the draft with recompute (checkpoint's saved-tensor hooks) and three TTT steps."""
    arch = small_arch(num_layers=2, attention="chunked")
    g = torch.Generator().manual_seed(1)
    T = sum(LENGTHS)
    args = (
        torch.randn(T, 3, 16, generator=g),
        torch.randn(T, 16, generator=g),
        torch.randint(0, 40, (T,), generator=g),
        torch.rand(T, generator=g) < 0.7,
        torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()]),
        TTT,
    )
    grads = []
    for engine in ("cpp", "python"):
        torch.manual_seed(0)
        model = Eagle3Draft(arch).double()
        for layer in model.layers:
            layer.recompute = True
        loss, _ = model(*(a.double() if a.is_floating_point() else a for a in args[:2]), *args[2:])
        nodes = loss.backward() if engine == "cpp" else fc.backward(loss)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert nodes > 100
    for name, ref in grads[0].items():
        torch.testing.assert_close(grads[1][name], ref, rtol=0, atol=1e-12, msg=name)


CHECKS = {
    "bf16 x float32 GEMM": lambda d: (
        torch.randn(4, 8, device=d).bfloat16() @ torch.randn(8, 2, device=d)
    ),
    "out_dtype float16 for bf16": lambda d: torch.mm(
        torch.randn(4, 8, device=d, dtype=torch.bfloat16),
        torch.randn(8, 2, device=d, dtype=torch.bfloat16),
        out_dtype=torch.float16,
    ),
    "host tensor moved in the step": lambda d: torch.tensor([1.0], device=d),
    "value read in the step": lambda d: float(torch.ones(2, device=d).sum()),
    "data-dependent shape": lambda d: torch.ones(3, device=d).nonzero(),
}


@pytest.mark.parametrize("name", list(CHECKS))
def test_the_strict_checks_are_not_blind(name) -> None:
    """What the real GPU would refuse or stall on fails here (each check's negative control)."""
    with fc.fake_cuda() as mode, pytest.raises(fc.FakeCudaViolation), mode.step():
        CHECKS[name](fc.DEVICE)


@pytest.mark.parametrize("bad", ["float32 q", "int64 cu_seqlens"])
def test_the_flash_kernel_dtypes_are_checked(bad) -> None:
    T, h, d = 8, 2, 16
    with fc.fake_cuda(), pytest.raises(fc.FakeCudaViolation, match=r"float32|int32"):
        q = torch.randn(T, h, d, device=fc.DEVICE, dtype=torch.bfloat16)
        cu = torch.tensor([0, 3, 8], dtype=torch.int32).to(fc.DEVICE)
        if bad == "float32 q":
            q = q.float()
        else:
            cu = cu.long()
        torch.ops.aten._flash_attention_forward(q, q, q, cu, cu, 5, 5, 0.0, True, False)


def test_alignment_refuses_int64_cu_seqlens() -> None:
    """The batch's document boundaries reach the flash kernel as int32 (the loader's are
    int64): an Alignment with int64 ones is refused where it is built, naming the field."""
    T = sum(LENGTHS)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    al = align(torch.zeros(T, dtype=torch.long), torch.ones(T, dtype=torch.bool), cu, TTT)
    assert al.cu_seqlens.dtype == torch.int32
    with pytest.raises(ValueError, match=r"Alignment\.cu_seqlens: dtype torch\.int64"):
        dataclasses.replace(al, cu_seqlens=al.cu_seqlens.long())


@pytest.mark.parametrize(
    ("gpu", "kernel"),
    [(fc.T4, "chunked"), (fc.H200, "flash"), (fc.B200, "flash"), (fc.RTX_PRO_6000, "flash")],
    ids=["sm_75", "sm_90", "sm_100", "sm_120"],
)
def test_the_attention_kernel_is_chosen_by_compute_capability(gpu, kernel) -> None:
    """draft.attention: auto on each GPU: torch's FlashAttention-2 where it runs (sm_80 to
    sm_121: Hopper and both Blackwells), the chunked reference below (a T4); preflight names
    the kernel, the GPU and its SM (on the fallback, why)."""
    from eagle3_train.model.flash_attention import resolve_attention
    from eagle3_train.preflight.device import check_attention_kernel

    with fc.fake_cuda(gpu=gpu):
        assert resolve_attention("auto", fc.DEVICE, torch.bfloat16) == kernel
        assert resolve_attention("auto", fc.DEVICE, torch.float32) == "chunked"  # not its dtype
        if kernel == "chunked":  # on flash, preflight's self-check reads values: not fakeable
            (finding,) = check_attention_kernel(small_arch(attention="auto"), fc.DEVICE, "bf16")
            assert finding.level == "ok", finding
            note = finding.message
        else:
            from eagle3_train.model.flash_attention import attention_kernel_note

            note = attention_kernel_note("auto", fc.DEVICE, torch.bfloat16)
    sm = f"sm_{gpu.major}{gpu.minor}"
    assert f"{gpu.name}, {sm})" in note, note
    expected = "FlashAttention-2" if kernel == "flash" else "chunked reference (flash needs"
    assert expected in note, note


@pytest.mark.parametrize("free_gib", [0.5, 100.0])
def test_preflight_memory_reads_the_device(tmp_path, free_gib) -> None:
    """preflight/device.check_memory on cuda:0 compares with the GPU's free memory
    (torch.cuda.mem_get_info), one process per device."""
    config = Config()
    config.output_dir = str(tmp_path / "run")
    memory = fc.Memory(free=int(free_gib * 2**30))
    with fc.fake_cuda(memory):
        findings = check_memory(
            SimpleNamespace(config=config), small_arch(), fc.DEVICE, 8, 2, {"peak_mib": 1024.0}
        )
    assert memory.queries == 1
    (memory_finding,) = [f for f in findings if f.check == "memory"]
    assert f"GPU {fc.DEVICE}" in memory_finding.message
    assert memory_finding.level == ("error" if free_gib < 1 else "ok"), memory_finding


@pytest.fixture
def accelerate_on_cuda(monkeypatch):
    """Accelerate as on one GPU: torch.cuda.is_available true (no tensor is made here, so
    nothing tries a real copy), one device; Accelerate's process-wide state and torch's
    float32 matmul precision restored afterwards."""
    from accelerate.state import AcceleratorState

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a, **k: None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    precision = torch.get_float32_matmul_precision()
    AcceleratorState._reset_state(True)
    yield
    AcceleratorState._reset_state(True)
    torch.set_float32_matmul_precision(precision)


@pytest.mark.parametrize("tf32", [True, False])
def test_the_accelerator_on_cuda_runs_bf16_and_sets_matmul_precision(
    tmp_path, accelerate_on_cuda, tf32
) -> None:
    """components/accelerator on a GPU: ``mixed_precision: auto`` is bf16, the Accelerator's
    device is cuda (not cpu=True) and train.tf32 sets the float32 matmul precision."""
    from eagle3_train.components.accelerator import start_accelerator

    config = Config()
    config.output_dir = str(tmp_path / "run")
    config.train.tf32 = tf32
    torch.set_float32_matmul_precision("medium")  # neither answer: the call must set it
    with fc.fake_cuda():
        accelerator = start_accelerator(config, preflight_only=True)
    assert accelerator.device.type == "cuda"
    assert accelerator.mixed_precision == "bf16"
    assert torch.get_float32_matmul_precision() == ("high" if tf32 else "highest")


@pytest.mark.parametrize("on_non_finite", ["skip", "stop"])
def test_the_loop_on_cuda_reads_back_two_steps_late(tmp_path, on_non_finite) -> None:
    """run/loop.Loop on a CUDA accelerator: the non-finite watch and the preempt vote read
    their device flags back ``lag`` = 2 optimizer steps late (no host sync per step); on CPU
    it is 0. The run is the few fields Loop's constructor reads."""
    from eagle3_train.components.checkpoint import TrainerState
    from eagle3_train.run.loop import Loop

    config = Config()
    config.output_dir = str(tmp_path / "run")
    config.train.on_non_finite = on_non_finite
    config.train.progress_bar = False
    accelerator = Accelerator()
    accelerator.is_main_process, accelerator.process_index = True, 0
    run = SimpleNamespace(
        config=config,
        accelerator=accelerator,
        state=TrainerState(),
        stream=None,
        model=torch.nn.Linear(2, 2),
        inputs=SimpleNamespace(config=config),
        arch=small_arch(),
        order=SimpleNamespace(validation_idx=[]),
        metrics_path=tmp_path / "metrics.jsonl",
        total_steps=4,
    )
    cleanup: list = []
    try:
        loop = Loop(run, cleanup)
    finally:
        for undo in reversed(cleanup):
            undo()
    assert loop.lag == 2
    assert loop.watch.lag == 2 and loop.preempt.lag == 2
    assert isinstance(loop.watch, NonFiniteSkip) == (on_non_finite == "skip")


# the compiled decoder layers (2 layers), loss chunk bodies, attention and the target's
# log-probabilities, measured
GRAPHS = 13
BREAK = "ttt_attend"  # the one intended break: @torch.compiler.disable on the attention step
# the flash attention compiled on its own, one graph per TTT step's number of diagonal keys
# (0 and 1 are specialised, then one dynamic graph): 0, 1, 2 at TTT 3
FLASH_GRAPHS = 3


def calls(graph: torch.fx.GraphModule, op: str) -> bool:
    """The graph or one of its bodies (an autograd.Function's forward and backward) calls the
    operator named ``op`` (as Dynamo records it: the op or one of its overloads)."""
    return any(
        node.op == "call_function" and str(node.target).split(".default")[0] == op
        for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
    )


def only_gemm(graph: torch.fx.GraphModule) -> bool:
    """The graph computes one linear layer and views of its input, nothing else."""
    ops = [
        getattr(n.target, "__name__", n.target)
        for n in graph.graph.nodes
        if n.op in ("call_function", "call_method")
    ]
    return ops.count("linear") == 1 and set(ops) <= {"linear", "transpose", "reshape", "view"}


@pytest.fixture
def inductor():
    """train.compile's graphs through Inductor targeting sm_90 on fake cuda:0: each graph's
    Triton kernels generated and compiled to cubin, not loaded (that needs the GPU), the graph
    then run as Dynamo captured it (support/fake_cuda.inductor_for)."""
    from torch._dynamo.utils import counters

    from eagle3_train.model.draft import compile_target_distribution
    from eagle3_train.model.flash_attention import compile_flash_attention
    from eagle3_train.model.loss import compile_kl_chunk

    torch._dynamo.reset()
    counters.clear()
    yield counters
    compile_kl_chunk(False)  # module state speed_up set
    compile_flash_attention(False)
    compile_target_distribution(False)
    torch._dynamo.reset()


def test_compiled_step_graphs_and_breaks(step_config, inductor) -> None:
    """train.compile on CUDA: Dynamo traces the layers, the flash attention and the KL chunk on
    cuda:0 tensors under bf16 autocast; the graph count is fixed and the only breaks are the
    intended ones (a new break, e.g. a host read inside a compiled layer, fails here); the
    flash kernel sits in the attention's graphs as a custom op, its merge fused by Inductor;
    the layers take their GEMM weights in bf16, cast once per step; Inductor lowers every
    graph for an H200 and each one but a lone GEMM yields Triton kernels compiled for sm_90."""
    check_compiled_step(step_config, inductor, fc.H200)


@pytest.mark.parametrize("sm", ["sm_100", "sm_120"])
class TestBlackwell:
    """The same step compiled for a B200 (sm_100) and an RTX PRO 6000 Blackwell (sm_120). A
    class is its own xdist scope: these run on the second worker beside the module's others."""

    def test_compiled_step_graphs_and_breaks(self, step_config, inductor, sm) -> None:
        check_compiled_step(step_config, inductor, fc.GPUS[sm])


def check_compiled_step(step_config: Config, counters, gpu) -> None:
    """One compiled training step on ``gpu``: graphs, breaks, kernels and their cubins' SM."""
    step_config.train.compile = "auto"  # on for CUDA
    accelerator = Accelerator()
    with fc.fake_cuda(gpu=gpu) as mode, fc.inductor_for(gpu) as run:
        model = make_model(small_arch(num_layers=2), step_config, accelerator)
        _, _, record = train_step(mode, model, step_config, accelerator)
        assert_trained(model, record)
    graphs = run.graphs
    assert len(graphs) == GRAPHS, [g.code for g in graphs]
    # the flash kernel's custom ops inside compiled graphs, forward and backward, with the
    # merge's log-sum-exp fused into an Inductor kernel of the same graph
    flash = [
        kernels
        for g, kernels in zip(graphs, run.kernels, strict=True)
        if calls(g, "eagle3.flash_forward") and calls(g, "eagle3.flash_backward")
    ]
    assert len(flash) == FLASH_GRAPHS, [g.code for g in graphs]
    assert all(any("logsumexp" in k for k in kernels) for kernels in flash), flash
    # the target's log-probabilities: the norm and the softmax with its argmax, fused
    (target,) = [
        kernels
        for g, kernels in zip(graphs, run.kernels, strict=True)
        if any(n.op == "placeholder" and n.name == "l_last_hidden_" for n in g.graph.nodes)
    ]
    assert any("rsqrt" in k for k in target) and any("argmax" in k for k in target), target
    breaks = dict(counters["graph_break"])
    assert breaks and all(BREAK in reason for reason in breaks), breaks
    devices = {
        str(n.meta["example_value"].device)
        for g in graphs
        for n in g.graph.nodes
        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.Tensor)
    }
    assert "cuda:0" in devices, devices
    # the layers' GEMM weights enter their graphs in bf16, cast once per step (draft.cast_once)
    weights = {
        n.name: n.meta["example_value"].dtype
        for g in graphs
        for n in g.graph.nodes
        if n.op == "placeholder" and "_parameters_weight_" in n.name and "norm" not in n.name
    }
    assert weights and set(weights.values()) == {torch.bfloat16}, weights
    # every graph yields Triton kernels but one that is a lone GEMM (cuBLAS): with its weight
    # cast inside, the o_proj graph's one Triton kernel was that cast, on every TTT call
    lone_gemms = [g for g, k in zip(graphs, run.kernels, strict=True) if not k]
    assert all(only_gemm(g) for g in lone_gemms), [g.code for g in lone_gemms]
    binaries = [b for per_graph in run.binaries for b in per_graph]
    # asked for the GPU's SM, and ptxas made a cubin for that SM of each kernel
    assert {(b["target"], b["sm"]) for b in binaries} == {(fc.sm(gpu), fc.sm(gpu))}, [
        (b["target"], b["sm"]) for b in binaries
    ]
