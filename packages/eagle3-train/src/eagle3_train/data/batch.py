"""One batch of training or validation: how the loader checks its rows, and its forward pass
(the TTT alignment computed on the host, the draft on the device)."""

from __future__ import annotations

import torch

from eagle3_train.config.run_config import Config
from eagle3_train.data.loader import to_device
from eagle3_train.model.shift import align


def verify_mode(config: Config) -> str | None:
    """What the loader does with a row whose checksum fails (None: rows are not checked)."""
    return config.data.on_corrupt if config.data.verify_rows else None


def forward(
    model, batch, accelerator, config: Config, training: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, stats) of one host batch: the TTT alignment is computed on the host (its counts
    are Python ints there) and moved with the batch, so the step needs no host sync.
    ``training``: a training micro-batch, which gets train.hidden_noise."""
    t = config.train
    al = align(batch["input_ids"].long(), batch["loss_mask"], batch["cu_seqlens"], t.ttt_steps)
    b = to_device(batch, accelerator.device)
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
            alignment=al.to(accelerator.device),
            objective=t.objective,
        )


def add_relative_noise(hidden: torch.Tensor, scale: float) -> torch.Tensor:
    """hidden (tokens, layers, width) + N(0, (scale x each row's RMS)^2), drawn on hidden's
    device from the seeded RNG (checkpoints keep its state: a resumed run draws alike)."""
    x = hidden.float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    return (x + torch.randn_like(x) * rms * scale).to(hidden.dtype)
