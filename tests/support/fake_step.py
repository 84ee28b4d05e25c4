"""One training step of the trainer's own code on fake ``cuda:0`` tensors (support.fake_cuda):
the batch as the loader hands it over (pinned host tensors), ``data.batch.forward`` (host-side
alignment, non-blocking copies, bf16 autocast), backward by the Python engine, the optimizer.
The CUDA dry-run tier's step (tests/test_cuda_dry_run.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch

from eagle3_train.components.build import speed_up
from eagle3_train.config.run_config import Config
from eagle3_train.data import batch as batch_module
from eagle3_train.data.loader import SlotState
from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.shift import align

from support import fake_cuda as fc

TTT = 3
LENGTHS = (11, 5, 16)  # three packed documents


class Accelerator(SimpleNamespace):
    """What the step asks of Accelerate on one CUDA process (Accelerate itself would look for a
    real device): its device, bf16 autocast, the reduction across ranks (one rank: itself).
    ``autocast_cache`` off: autocast casts a weight at every use, as it does inside compiled
    graphs, which its cache of casts does not reach."""

    def __init__(self, processes: int = 1, autocast_cache: bool = True) -> None:
        super().__init__(
            device=fc.DEVICE,
            mixed_precision="bf16",
            num_processes=processes,
            state=SimpleNamespace(deepspeed_plugin=None),
            sync_gradients=True,
            autocast_cache=autocast_cache,
        )

    def autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=self.autocast_cache)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return tensor * self.num_processes  # every rank voted alike


def host_batch(
    mode: fc.StrictFakeCuda,
    hidden: int,
    vocab: int,
    lengths: tuple[int, ...] = LENGTHS,
    scored: float | None = None,
) -> dict[str, torch.Tensor]:
    """A packed batch as the loader hands it over with ``pin_memory`` (host tensors, page-locked,
    the loader's dtypes: int64 cu_seqlens). Fake host tensors; ``shift.align``, which reads
    their values on the host, gets the real ones (``real_align``). ``scored``: the share of
    each document the loss scores (its end, the answer); by default a random 70 % of tokens."""
    with fc.on_host():
        g = torch.Generator().manual_seed(0)
        T = sum(lengths)
        starts = torch.tensor([0, *lengths]).cumsum(0)
        if scored is None:
            loss_mask = torch.rand(T, generator=g) < 0.7
        else:  # each document's end
            loss_mask = torch.cat([torch.arange(n) >= round(n * (1 - scored)) for n in lengths])
        real = {
            "aux_hidden_states": torch.randn(T, 3, hidden, generator=g).bfloat16(),
            "last_hidden_state": torch.randn(T, hidden, generator=g).bfloat16(),
            "input_ids": torch.randint(0, vocab, (T,), generator=g, dtype=torch.int32),
            "loss_mask": loss_mask.to(torch.uint8),
            "cu_seqlens": starts,
        }
    REAL_BATCH.clear()
    REAL_BATCH.update(real)
    return {k: fc.fake_host(mode, v, pinned=True) for k, v in real.items()}


REAL_BATCH: dict[str, torch.Tensor] = {}


def real_align(input_ids, loss_mask, cu_seqlens, ttt_steps):
    """shift.align on the host batch's real values, its tensors then fake host ones."""
    mode = input_ids.fake_mode
    with fc.on_host():
        b = REAL_BATCH
        al = align(b["input_ids"].long(), b["loss_mask"], b["cu_seqlens"], ttt_steps)
    fields = {f.name: getattr(al, f.name) for f in dataclasses.fields(al)}
    return type(al)(
        **{
            n: [mode.from_tensor(x) for x in v]
            if isinstance(v, list) and v and torch.is_tensor(v[0])
            else mode.from_tensor(v)
            if torch.is_tensor(v)
            else v
            for n, v in fields.items()
        }
    )


def make_model(arch, config: Config, accelerator: Accelerator) -> Eagle3Draft:
    with torch.device(fc.DEVICE):
        model = Eagle3Draft(arch)
    speed_up(model, config, accelerator)
    return model


def train_step(
    mode: fc.StrictFakeCuda,
    model,
    config: Config,
    accelerator: Accelerator,
    optimizer=None,
    *,
    lengths: tuple[int, ...] = LENGTHS,
    scored: float | None = None,
    count: bool = False,
):
    """The trainer's micro-batch: data.batch.forward, backward, clipping (where
    ``train.max_grad_norm`` is set and an optimizer steps) and the optimizer step. ``count``:
    the step's FLOPs and bytes are counted, by phase (StepRecord)."""
    arch = model.arch
    batch = host_batch(mode, arch.hidden_size, arch.target_vocab_size, lengths, scored)
    slot = SlotState()  # a recycled batch (the loop's loader: recycle=True) holds its ring slot
    batch["lease"] = slot.lend()
    pairs = sum(n * (n + 1) // 2 for n in lengths) if count else None
    with mode.step(causal_pairs=pairs) as record:
        loss, stats = batch_module.forward(model, batch, accelerator, config)
        record.phase = "backward"
        fc.backward(loss)
        if optimizer is not None:
            record.phase = "optimizer"
            if config.train.max_grad_norm:
                params = model.trainable_parameters()
                torch.nn.utils.clip_grad_norm_(params, config.train.max_grad_norm)
            optimizer.step()
    # the slot is released fenced by an event recorded after the copies (not waited for)
    assert isinstance(slot._fence, fc.FakeEvent) and slot._fence.is_recorded
    assert not slot._fence.synchronized
    return loss, stats, record
