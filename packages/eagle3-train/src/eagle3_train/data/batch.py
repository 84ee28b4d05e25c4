"""One batch of training or validation: how the loader checks its rows, its move to the device
(on CUDA, one batch ahead on a side stream) and its forward pass (the TTT alignment computed
on the host, the draft on the device)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from eagle3_train.config.run_config import Config
from eagle3_train.data.dataset import Batch
from eagle3_train.data.loader import to_device
from eagle3_train.model.shift import Alignment, align


def verify_mode(config: Config) -> str | None:
    """What the loader does with a row whose checksum fails (None: rows are not checked)."""
    return config.data.on_corrupt if config.data.verify_rows else None


@dataclass
class Staged:
    """A batch's inputs and TTT alignment on the device. ``ready``: the event recorded on the
    copy stream after its copies (None: enqueued on the stream that computes)."""

    inputs: dict[str, torch.Tensor]
    alignment: Alignment
    ready: Any = None

    def take(self) -> tuple[dict[str, torch.Tensor], Alignment]:
        """The inputs for the current stream: it waits for the copies on the device (the host
        does not), and the tensors are marked as used by it, so that the caching allocator
        does not hand their memory back to the copy stream before this step is done."""
        if self.ready is not None:
            current = torch.cuda.current_stream(self.alignment.doc_start.device)
            current.wait_event(self.ready)
            for tensor in self._tensors():
                tensor.record_stream(current)
        return self.inputs, self.alignment

    def _tensors(self) -> Iterator[torch.Tensor]:
        yield from self.inputs.values()
        for field in dataclasses.fields(self.alignment):
            value = getattr(self.alignment, field.name)
            if torch.is_tensor(value):
                yield value
            elif isinstance(value, list):
                yield from (x for x in value if torch.is_tensor(x))


def stage(batch: Batch, device: torch.device, ttt_steps: int, stream: Any = None) -> Staged:
    """The TTT alignment computed on the host (its counts are Python ints there), then the batch
    and the alignment moved to ``device`` — on ``stream`` if given (a CUDA side stream), with
    an event after the copies for the stream that computes to wait on."""
    al = align(batch["input_ids"].long(), batch["loss_mask"], batch["cu_seqlens"], ttt_steps)
    if stream is None:
        return Staged(to_device(batch, device), al.to(device))
    with torch.cuda.stream(stream):
        inputs, alignment = to_device(batch, device), al.to(device)
        ready = torch.cuda.Event()
        ready.record(stream)
    return Staged(inputs, alignment, ready)


def ahead_to_device(
    batches: Iterable[Batch], device: torch.device, ttt_steps: int
) -> Iterator[Batch]:
    """Training batches, each with its ``staged`` inputs. On CUDA the next batch's copies are
    enqueued on a side stream before the current batch is handed out, so they run while the
    current step computes (on the compute stream they would wait for it, and it for them).
    A recycled batch stays valid until two further batches were fetched (loader.BatchStream),
    so the one held ahead is. On CPU each batch is staged when its step takes it."""
    if device.type != "cuda":
        yield from batches
        return
    stream = torch.cuda.Stream(device)
    held: Batch | None = None
    for batch in batches:
        batch["staged"] = stage(batch, device, ttt_steps, stream)
        if held is not None:
            yield held
        held = batch
    if held is not None:
        yield held


def forward(
    model, batch, accelerator, config: Config, training: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, stats) of one batch: staged ahead (``ahead_to_device``) or now, on the stream that
    computes; nothing in it waits on the host. ``training``: a training micro-batch, which
    gets train.hidden_noise."""
    t = config.train
    staged = batch.get("staged") or stage(batch, accelerator.device, t.ttt_steps)
    b, al = staged.take()
    aux = b["aux_hidden_states"]
    if training and t.hidden_noise > 0:
        aux = add_relative_noise(aux, t.hidden_noise)
    with accelerator.autocast():
        return model(
            aux,
            b["last_hidden_state"],
            b["input_ids"],
            b["loss_mask"],
            b["cu_seqlens"],
            t.ttt_steps,
            t.ttt_step_loss_decay,
            alignment=al,
            objective=t.objective,
        )


def add_relative_noise(hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """hidden (tokens, layers, width) + N(0, (scale x each row's RMS)^2), drawn on hidden's
    device from the seeded RNG (checkpoints keep its state: a resumed run draws alike)."""
    x = hidden.float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    return (x + torch.randn_like(x) * rms * scale).to(hidden.dtype)
