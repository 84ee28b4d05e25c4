"""speculators 0.9.0's side of the benches, as a plain loop around its `Eagle3DraftModel` and its
own optimizer, schedule and loss builders: the arms (its `speculators train` arguments), the run
built as its trainer builds it, its loss on a packed batch of eagle3-train's loader, and the loop
(bench_vs_speculators.py's speculators child; first_step_vs_speculators.py; bench_train.py's
speculators side packs its batch alike).

Its own training entry point wants CUDA (FlexAttention, fused Triton loss, FSDP), so the loop is
configured by its own `speculators train` argument parser (speculators/train/config/
resolution.py `resolve`) with only the verifier, --lr and --max-steps given, so every other
setting is the 0.9.0 eagle3 default as a user gets it. Read in speculators 0.9.0 (the installed
package): train/config/schema.py — unset norm_before_fc / norm_output become true for eagle3,
norm_before_residual true, fc_norm false, embed_requires_grad false (and model.py freezes the
draft's lm_head); OptimizerArgs: optimizer muon, lr 1e-3, muon_lr = lr, muon momentum 0.95,
weight decay 0.1, ns_steps 5, adjust_lr_fn match_rms_adamw, AdamW weight decay 0.01;
SchedulerArgs: linear, warmup unset = 1 % of the steps (train/trainer.py
`_resolve_scheduler_steps`), one schedule per optimizer; LossArgs: kl_div, ttt_steps 3,
ttt_step_loss_decay 1.0; train/trainer.py: gradient clip 1.0. train/optimizers.py
`build_optimizers` splits Muon (2-D matrices but embeddings / lm_head) from AdamW (torch
defaults betas 0.9/0.999). No hidden-state noise: 0.9.0 has none (its DataArgs carry no
noise_std; the uniform noise of half-width 0.05 its train loader added before is gone), so the
default a user gets is the one measured (ours' counterpart: train.hidden_noise). Two
departures, both forced by the CPU: sdpa attention (its FlexAttention default has no CPU
backward) and the eager loss (the fused one is Triton).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiny_runs import Recipe, epoch_batches

# speculators' arms: `speculators train` arguments beyond the verifier, --lr and --max-steps
SPECULATORS_ARMS = {
    "speculators": [],  # the 0.9.0 eagle3 defaults (EAGLE 3.1 norms, Muon, linear, kl_div)
    # the anchor of docs/benchmarks/vs-speculators.md's tables before 0.9.0 made Muon the default
    "speculators-adamw": ["--optimizer", "adamw", "--scheduler-warmup-steps", "20"],
    # Muon at 1e-3 (its default, = --lr) learns slowly in 150 steps; a user tuning it sets this
    # (ours' muon-lr5e-3 arm sets the same, train.muon.lr)
    "speculators-muon-lr5e-3": ["--muon-lr", "5e-3"],
    # its LK loss (the TV-aware hybrid), tuned alike: its best guess for sampled serving (ours'
    # lk and tv arms against it at T > 0: docs/benchmarks/sampling.md)
    "speculators-muon-lr5e-3-lk_hybrid": ["--muon-lr", "5e-3", "--loss-fn", "lk_hybrid"],
}
# its trainer's fixed clip (speculators/train/trainer.py, clip_grad_norm_(..., 1.0))
SPECULATORS_CLIP = 1.0


def pack_documents(batch: dict) -> tuple[dict, Any]:
    """speculators' own per-document shift (``shift_batch``) of each document of a batch in
    eagle3-train's loader's keys, then packing: the packed batch its model takes (each tensor
    ``[1, T]``) and the document id of each row (``[1, T]``)."""
    import torch
    from speculators.models.eagle3.data import shift_batch

    ids, aux, last = batch["input_ids"], batch["aux_hidden_states"], batch["last_hidden_state"]
    parts = []
    for start, end in itertools.pairwise(batch["cu_seqlens"].tolist()):
        n = end - start
        parts.append(
            shift_batch(
                {
                    "input_ids": ids[start:end],
                    "hidden_states": aux[start:end].float().reshape(n, -1),
                    "verifier_last_hidden_states": last[start:end].float(),
                    "loss_mask": batch["loss_mask"][start:end],
                    "lengths": torch.tensor([n]),
                    "position_ids": torch.arange(n),
                }
            )
        )
    cat = {k: torch.cat([p[k] for p in parts])[None] for k in parts[0] if k != "lengths"}
    documents = torch.cat([torch.full((len(p["input_ids"]),), i) for i, p in enumerate(parts)])
    return cat, documents[None]


def speculators_layer_config(recipe: Recipe):
    """The Llama layer speculators' draft is built of: the target's own config for a Llama
    target; for the MLA target a Llama config at its text model's width, heads, MLP, norm and
    RoPE — the sizes eagle3-train's Llama-style draft copies from it."""
    from transformers import AutoConfig, LlamaConfig

    config = AutoConfig.from_pretrained(recipe.target)
    if not recipe.mla_target:
        return config
    t = config.text_config
    copied = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    copied += ("num_key_value_heads", "rms_norm_eps", "max_position_embeddings")
    return LlamaConfig(
        **{key: getattr(t, key) for key in copied},
        **{f"{name}_token_id": getattr(t, f"{name}_token_id") for name in ("bos", "eos", "pad")},
        head_dim=t.hidden_size // t.num_attention_heads,
        rope_parameters=dict(t.rope_parameters),
        architectures=config.architectures,
    )


def speculators_config(
    layer,
    draft_vocab_size: int,
    aux_layer_ids: list[int],
    speculative_tokens: int,
    verifier: str | None,
    architectures: list[str],
    **draft: Any,
):
    """speculators' eagle3 draft config of ``layer``, proposing greedily ``speculative_tokens``
    tokens for the ``verifier``; ``draft``: its norm and embedding settings."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=draft_vocab_size,
        eagle_aux_hidden_state_layer_ids=aux_layer_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=architectures),
        ),
        **draft,
    )


@dataclass
class SpeculatorsRun:
    """speculators' side of a run, built as its trainer builds it: the draft, its optimizers
    and their schedules, the resolved `speculators train` arguments and the loss."""

    model: Any
    optimizers: list
    schedules: list
    cli: Any
    loss_config: Any


def speculators_run(
    recipe: Recipe, run: Path, steps: int, lr: float, seed: int, arm: str, batches: int
) -> SpeculatorsRun:
    """The draft (seeded by ``seed``) and its optimizers and schedules for ``steps`` steps over
    ``batches`` batches, with ``arm``'s `speculators train` arguments."""
    from types import SimpleNamespace

    import torch
    from safetensors.numpy import load_file
    from speculators.losses.utils import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel
    from speculators.train.config.resolution import resolve
    from speculators.train.config.schema import TrainConfig
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import _resolve_scheduler_steps
    from transformers import get_linear_schedule_with_warmup

    from eagle3_train.data.dataset import HiddenStateDataset

    # speculators' own `speculators train` argument parsing and default resolution
    argv = ["--verifier-name-or-path", str(recipe.target), "--speculator-type", "eagle3"]
    argv += ["--lr", str(lr), "--max-steps", str(steps), *SPECULATORS_ARMS[arm]]
    cli = resolve(TrainConfig, argv)
    if cli.scheduler.scheduler_type != "linear":
        raise SystemExit(f"speculators arm {arm}: schedule {cli.scheduler.scheduler_type!r}")
    torch.manual_seed(seed)
    dataset = HiddenStateDataset(run / "hidden_states")
    layer = speculators_layer_config(recipe)
    layer.num_hidden_layers = 1
    layer._attn_implementation = "sdpa"  # its FlexAttention default has no CPU backward
    vocab = load_file(str(run / "vocab_map.safetensors"))
    norms = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
    config = speculators_config(
        layer,
        int(vocab["d2t"].shape[0]),
        list(dataset.aux_layer_ids),
        3,
        str(recipe.target),
        layer.architectures,
        **{key: getattr(cli.draft, key) for key in (*norms, "embed_requires_grad")},
    )
    model = Eagle3DraftModel(config)
    model.load_vocab_mappings(torch.from_numpy(vocab["t2d"]), torch.from_numpy(vocab["d2t"]))
    model.load_verifier_weights()
    optimizers = build_optimizers(model, SimpleNamespace(**cli.optimizer.model_dump()))
    timing = {"num_epochs": cli.trainer.epochs, "max_steps": steps} | cli.scheduler.model_dump()
    warmup, total = _resolve_scheduler_steps(SimpleNamespace(**timing), batches)
    schedules = [get_linear_schedule_with_warmup(o, warmup, total) for o in optimizers]
    return SpeculatorsRun(
        model, optimizers, schedules, cli, resolve_loss_config(cli.loss.loss_fn, "eager")
    )


def speculators_loss(s: SpeculatorsRun, batch: dict):
    """speculators' loss of one packed batch of eagle3-train's loader (on the CPU), each
    document shifted by its own ``shift_batch``."""
    import warnings

    cat, documents = pack_documents(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, loss, _ = s.model(
            **cat,
            document_ids=documents,
            ttt_steps=s.cli.loss.ttt_steps,
            ttt_step_loss_decay=s.cli.loss.ttt_step_loss_decay,
            loss_config=s.loss_config,
        )
    return loss


def speculators_child(
    recipe: Recipe, run: Path, out: Path, steps: int, lr: float, seed: int, arm: str
) -> None:
    """The plain loop (runs in its own process, so its time includes its own imports)."""
    import torch

    from eagle3_train.data.dataset import HiddenStateDataset
    from eagle3_train.data.loader import make_loader, to_device

    plan = epoch_batches(run / "hidden_states", steps, seed)
    s = speculators_run(recipe, run, steps, lr, seed, arm, len(plan))
    dataset = HiddenStateDataset(run / "hidden_states")
    for batch in make_loader(dataset, plan, num_workers=0):
        loss = speculators_loss(s, to_device(batch, torch.device("cpu")))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(s.model.parameters(), SPECULATORS_CLIP)
        for optimizer, schedule in zip(s.optimizers, s.schedules, strict=True):
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
    s.model.save_pretrained(str(out / "draft"))
