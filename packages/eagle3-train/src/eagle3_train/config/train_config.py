"""The config's ``train:`` section: the loop, the optimizer and what the loss rewards.

Part of the typed train config (``run_config.py`` loads, checks and saves the whole of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class ObjectiveConfig:
    """What the TTT loss rewards beyond plain EAGLE-3 (each measured by vLLM on the tiny recipe,
    k = 3, 3 seeds per arm: tools/bench/bench_vs_speculators.py; docs/benchmarks/vs-speculators.md)."""

    # Harmonized objective distillation (HASS): add topk_weight * the cross-entropy of the
    # draft against the target's top-k tokens (-sum_{i in top-k(p)} p_i log q_i) to each
    # slot's KL, focusing the draft on the tokens the target would actually choose. Measured:
    # acceptance length 3.222 (3.210..3.230) with weight 1, k 10; 3.151 (3.130..3.174)
    # without. 0 = off (plain EAGLE-3, what speculators trains).
    topk: int = 10
    # Weight of the top-k term (0 = off).
    topk_weight: float = 1.0
    # The per-slot divergence from the target that the draft minimises (the top-k term adds
    # to any). "kl": KL(p || q), EAGLE-3's. "tv": total variation 1 - sum_i min(p_i, q_i);
    # 1 - TV is the probability that speculative sampling accepts the draft's token. "lk":
    # the LK hybrid (Samarin et al., arXiv 2602.23881; speculators' lk_hybrid)
    # λ·KL + (1 - λ)·TV with λ = exp(-lk_eta·(1 - TV)) held constant: KL's gradient while the
    # draft is far from the target, the acceptance rate's once it is close.
    divergence: Literal["kl", "tv", "lk"] = "kl"
    # η of the `lk` divergence's λ.
    lk_eta: float = 3.0


@dataclass
class MuonConfig:
    """train.optimizer: muon. Defaults are speculators 0.9.0's (``speculators/train/config/
    schema.py`` OptimizerArgs; split and construction in ``speculators/train/optimizers.py``)."""

    # null = train.lr (speculators: --muon-lr defaults to --lr); the schedule scales both.
    lr: float | None = None
    # Muon's momentum.
    momentum: float = 0.95
    # Muon's weight decay (on the hidden matrices).
    weight_decay: float = 0.1
    ns_steps: int = 5  # Newton–Schulz iterations orthogonalising each update
    # match_rms_adamw: the update's RMS made AdamW's (lr x 0.2·sqrt(max(rows, cols))), so one
    # lr suits both groups; original: Keller Jordan's sqrt(max(1, rows/cols)).
    adjust_lr_fn: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    # The dtype Newton–Schulz iterates in. auto: bf16 on CUDA (torch's, on tensor cores) and
    # float32 on a CPU, which emulates bf16; bfloat16 makes a CPU run iterate as a GPU run (and
    # as speculators' CPU loop). DeepSpeed's Muon iterates in bf16 only.
    newton_schulz_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    # Weight decay of the AdamW group (norms and the LM head) under muon; train.weight_decay
    # is AdamW's under train.optimizer: adamw.
    adamw_weight_decay: float = 0.01


@dataclass
class TrainLoopConfig:
    # Test-time-training steps unrolled per slot (the draft proposes this many tokens in training;
    # vLLM's k is `export.speculative_tokens`).
    ttt_steps: int = 3
    # TTT step k's loss weighs decay^k. Measured by vLLM on the tiny recipe (3 seeds): 0.8 with
    # the top-k term 3.241 (3.235..3.247), 1.0 with it 3.222 (3.210..3.230).
    ttt_step_loss_decay: float = 0.8
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    # Passes over the training split (`train.max_steps` stops earlier).
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; stops early when reached
    # Peak learning rate of AdamW (under `train.optimizer: muon`, of the AdamW group: norms and LM
    # head).
    lr: float = 1e-4
    # The schedule's floor, as a fraction of the peak lr.
    min_lr_ratio: float = 0.1
    # Optimizer steps of linear warm-up.
    warmup_steps: int = 50
    # The lr's decay after warm-up.
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    # "adamw": AdamW on every trained tensor. "muon": torch.optim.Muon on the hidden 2-D
    # matrices (fc, attention, MLP) and AdamW on the rest (norms and the LM head: embedding-like
    # rows never go to Muon), with train.muon's settings. Under DeepSpeed: ZeRO-2 only, through
    # DeepSpeed's Muon set up to step as torch's (build.make_deepspeed_muon), max_grad_norm
    # clipping the gradient before Newton–Schulz as here (components/zero_clip.py).
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon: MuonConfig = field(default_factory=MuonConfig)
    # AdamW's weight decay under `train.optimizer: adamw`.
    weight_decay: float = 0.0
    # AdamW's betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # AdamW's epsilon.
    adam_eps: float = 1e-8
    # Micro-batches per optimizer step.
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 0.5  # 0 = no clip
    # Gaussian noise on the target's auxiliary hidden states of each training micro-batch
    # (never validation's), std = hidden_noise x each token's RMS in that layer, so one value
    # suits any target's scale: EAGLE-1's remedy for the error the draft's own features
    # accumulate (speculators before 0.9.0 added uniform noise of half-width 0.05, absolute;
    # 0.9.0 adds none). 0 = off: vLLM AL at 600 steps on the tiny Llama, seed 0, 3.589 with 0.1
    # against 3.610 without (docs/benchmarks/vs-speculators.md).
    hidden_noise: float = 0.0
    # auto = bf16 autocast on CUDA, fp32 on CPU.
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    # On CUDA, float32 matmuls (the exact-softmax attention and the KL over the vocabulary,
    # kept in float32 under bf16 autocast) run on TF32 tensor cores: measured on an H200 they
    # were ~75% of a step at fp32's 1/15 of bf16's rate. False = IEEE float32. No effect on CPU.
    tf32: bool = True
    # torch.compile each decoder layer (attention stays opaque: its own kernels) and the
    # loss's chunk body. auto = on CUDA only (CPU: compilation costs more than it saves on
    # short runs).
    compile: Literal["auto", "always", "never"] = "auto"
    # Activation checkpointing: each decoder layer recomputed in backward, per TTT step
    # (recompute.py; also under train.compile): the same loss and gradients, bit for bit. Trades
    # one more forward of the layer for its activations: at the Kimi draft shape 1.74 -> ~1.22 MB
    # per token (bf16, 3 TTT steps: a ~67K -> ~96K-token sample per H200); on CPU at a tiny shape
    # step time +19 % (32K tokens) to +68 % (4K). For samples longer than fit without it;
    # recipes/kimi-k2.5/RESOURCES.md "Long samples".
    recompute: bool = False
    # Seeds the draft's initialisation and the sample order.
    seed: int = 0
    # A non-finite loss or gradient norm. "stop" (exit 3): nothing of the bad step is kept, the
    # last checkpoint stands. "skip": that optimizer step leaves weights and optimizer state
    # untouched (the batch is consumed, the LR schedule advances), a "skip" event with the
    # batch's sample ids goes to metrics.jsonl, and the run stops (exit 3) only after
    # `max_skips_in_row` skipped steps in a row. On CUDA the verdict reaches the fused AdamW
    # on the device (its found_inf, as GradScaler uses it): no host sync; elsewhere it is read
    # on the host before the step (free on CPU). Not under DeepSpeed, whose engine steps inside
    # backward (refused at start).
    on_non_finite: Literal["stop", "skip"] = "stop"
    # With `train.on_non_finite: skip`: skipped steps in a row that stop the run (exit 3).
    max_skips_in_row: int = 10
    # Signals that ask the run to stop at the next optimizer step with a checkpoint (exit 5;
    # rerun to resume exactly): SIGTERM is what Slurm and Kubernetes send before killing; add
    # e.g. SIGUSR1 for Slurm's `--signal=USR1@120`. Under several processes the signal
    # reaching any one rank stops all of them at the same step. [] = the default actions.
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    # Several processes: a collective that waits longer than this for another rank fails, and
    # the run stops (exit 8) naming it and the last checkpoint, instead of hanging (a dead or
    # frozen rank, a lost node). Must exceed the longest time one rank works alone while the
    # others wait (rank 0 writing an export or checkpoint). A rank killed outright is usually
    # noticed at once (its connections close).
    collective_timeout_s: float = 600.0
    # Optimizer steps between log lines and metrics events.
    log_every: int = 10
    save_every: int = 500  # optimizer steps between resumable checkpoints; 0 = epoch ends only
    # Resumable checkpoints kept (older ones deleted).
    keep_checkpoints: int = 2
    eval_every: int | None = None  # optimizer steps; validation also runs after every epoch
    # The validation metric that picks the best checkpoint.
    best_metric: str = "val/loss"
    # Whether `train.best_metric` is better low or high.
    best_mode: Literal["min", "max"] = "min"
    resume: str = "auto"  # auto (latest checkpoint under output_dir) | never | PATH
    # Run the verify-before-run checks before training (`--no-preflight` turns them off for one
    # run).
    preflight: bool = True
    # Full eagle3-schemas validation of every input (checksums of every row); turn off only
    # for datasets too large to re-hash before each run.
    validate_inputs: bool = True
    # Accelerate trackers the metrics also go to (`metrics.jsonl` is always written).
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    # The trackers' project name.
    project_name: str = "eagle3-train"
    # torch's CPU threads; null = torch's choice (`accelerate launch` sets 1 unless told otherwise).
    torch_threads: int | None = None
    # A progress bar on rank 0's terminal.
    progress_bar: bool = True
