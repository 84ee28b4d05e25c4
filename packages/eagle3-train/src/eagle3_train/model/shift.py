"""TTT alignment: THE shift.

The shift — applied here and nowhere else
-----------------------------------------
Stored data follows the schema convention: row ``t`` of every tensor belongs to position
``t`` (the target has seen ``x_0..x_t``; its distribution at ``t`` predicts ``x_{t+1}``;
``loss_mask[t] = 1`` when ``x_t`` is an assistant token).

The draft's *slot* ``t`` at TTT step ``k`` (k = 0 .. ttt_steps-1):

- is fed ``fc(aux[t])`` (step 0; later steps feed back the draft's own output) and the
  embedding of token ``x_{t+1+k}``;
- is trained toward the target distribution of row ``t+1+k``, i.e. the target's
  ``p(x_{t+2+k} | x_0..x_{t+1+k})`` restricted to the draft vocabulary;
- is scored where ``loss_mask[t+1+k] = 1`` and ``t+1+k`` lies in the same packed
  document as ``t``.

This is vLLM's serving alignment: ``EagleProposer.propose`` shifts the token ids left by one
(``input_ids[:-1] = target_token_ids[1:]``, last = the token just sampled) and pairs them
with the target hidden states of the *same* rows, at the rows' own positions; each further
draft step advances token and position by one. The draft runs exactly after the target has
produced ``x_{t+1}``, so the mask is read at the fed token ``t+1+k``: a slot counts when
the token it is conditioned on is an assistant token. speculators 0.9.0 arrives at the
same pairs by dropping ``x_0``, ``aux[T-1]``, ``last[0]``, ``loss_mask[0]`` per sample
(``shift_batch``) and then sliding targets by ``k`` per step.

Positions: slot ``t`` uses position ``t - doc_start`` (+k at step k), as vLLM does
(speculators uses ``+1``; RoPE only sees differences, so both give the same attention).

Differences from speculators by design (tests state them):
- speculators scores step ``k`` of the last ``k`` slots of a packed document against the
  *next* document's first rows; here those slots are not scored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Alignment:
    """Per TTT step: which token each slot is fed, and which slots are scored.

    Computed where the batch is (``align``); built on the host and moved with ``to``, its
    Python ints (document lengths, scored counts) keep the step free of host syncs."""

    doc_start: Tensor  # [T] long: first row of the slot's document
    positions: Tensor  # [T] long: position of slot t at step 0 (t - doc_start)
    step_tokens: list[Tensor]  # per step k: [T] long, x_{t+1+k} (0 past the end; never scored)
    in_doc: list[Tensor]  # per step k: [T] bool, t+1+k inside t's document
    valid: list[Tensor]  # per step k: [T] bool, in_doc & loss_mask[t+1+k]
    # per step k: the slots whose draft logits are formed — the scored ones, and those whose
    # step-0 row was scored (the accuracy chain of ``step_accuracy`` follows them)
    loss_rows: list[Tensor]
    num_scored: list[int]  # per step k: valid[k].sum()
    cu_seqlens: Tensor  # [n+1] int32, the kernels' document boundaries
    max_doc_len: int

    def __post_init__(self) -> None:
        # CUDA's FlashAttention varlen kernel takes int32 boundaries only; the loader builds
        # int64 ones (data/loader.py), which ``align`` converts
        if self.cu_seqlens.dtype != torch.int32:
            raise ValueError(
                f"Alignment.cu_seqlens: dtype {self.cu_seqlens.dtype}, expected torch.int32 "
                "(the flash kernel's document boundaries; align() converts the loader's int64)"
            )

    def to(self, device: torch.device) -> Alignment:
        def move(x: Tensor) -> Tensor:
            if x.device.type == "cpu" and torch.device(device).type == "cuda":
                x = x.pin_memory()  # non-blocking from pageable memory would stall the host
            return x.to(device, non_blocking=True)

        return Alignment(
            move(self.doc_start),
            move(self.positions),
            [move(x) for x in self.step_tokens],
            [move(x) for x in self.in_doc],
            [move(x) for x in self.valid],
            [move(x) for x in self.loss_rows],
            self.num_scored,
            move(self.cu_seqlens),
            self.max_doc_len,
        )


def document_bounds(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """doc_start [T] and doc_end [T] (exclusive) of every row of a packed sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
    ends = torch.repeat_interleave(cu_seqlens[1:], lengths, output_size=total)
    return starts, ends


def align(input_ids: Tensor, loss_mask: Tensor, cu_seqlens: Tensor, ttt_steps: int) -> Alignment:
    """The one shift (see the module docstring) for a packed, unshifted batch. Reads counts
    back to the host: call it on the host's copy of the batch, then ``Alignment.to``."""
    T = input_ids.shape[0]
    cu_seqlens = cu_seqlens.long()
    doc_start, doc_end = document_bounds(cu_seqlens, T)
    rows = torch.arange(T, device=input_ids.device)
    mask = loss_mask.bool()
    step_tokens, in_doc, valid, loss_rows, num_scored = [], [], [], [], []
    for k in range(ttt_steps):
        src = rows + 1 + k
        inside = src < doc_end
        safe = src.clamp(max=T - 1)
        step_tokens.append(torch.where(src < T, input_ids[safe], torch.zeros_like(input_ids)))
        in_doc.append(inside)
        valid.append(inside & mask[safe])
        loss_rows.append(torch.nonzero(valid[k] | (valid[0] & inside)).flatten())
        num_scored.append(int(valid[k].sum()))
    max_doc_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if T else 0
    return Alignment(
        doc_start,
        rows - doc_start,
        step_tokens,
        in_doc,
        valid,
        loss_rows,
        num_scored,
        cu_seqlens.to(torch.int32),
        max_doc_len,
    )
