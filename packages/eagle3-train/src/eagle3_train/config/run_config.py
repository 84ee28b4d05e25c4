"""The typed train config: defaults < YAML file < CLI overrides, saved as ``run.yaml``.

Every knob lives here, with its default and its meaning. Loading is strict: an unknown key, a
wrong type or an impossible value stops the run with a message naming the key, the value
found and what was expected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from eagle3_schemas.runtime.signals import parse_signals
from eagle3_train.config.coerce import ConfigError, build, merge
from eagle3_train.config.train_config import TrainLoopConfig


@dataclass
class TargetConfig:
    # Target model directory (config.json, optionally weights). Gives the draft layer's
    # defaults (heads, intermediate size, RoPE) and lets preflight compare its fingerprints
    # with the dataset's lineage. Optional: the trainer's target tensors (embeddings, final
    # norm, lm_head) come from the dataset's target_head.safetensors, the target's norm eps,
    # architecture, sizes and aux ids from dataset.json; without it, state the draft's shape
    # in `draft` (num_attention_heads, intermediate_size, max_position_embeddings, ...) unless
    # dataset.json `target` records those keys, and set name_or_path for the export.
    path: str | None = None
    # Written into the checkpoint as speculators_config.verifier.name_or_path (what the
    # draft is served with, e.g. a hub id). Defaults to `path`.
    name_or_path: str | None = None
    # Epsilon of the target's final RMSNorm, applied to the dataset's pre-norm last hidden
    # state. Resolution: this value > dataset.json target.rms_norm_eps > target config.json.
    rms_norm_eps: float | None = None


@dataclass
class DraftConfig:
    # Expected aux layer ids (vLLM convention). null = take the dataset's; set = the dataset
    # must carry exactly these (preflight refuses otherwise).
    aux_layer_ids: list[int] | None = None
    # "llama": vLLM's LlamaForCausalLMEagle3 layer (any target). "mla": vLLM's
    # Eagle3DeepseekV2ForCausalLM layer — DeepSeek MLA attention and a dense MLP — for MLA
    # targets (DeepSeek-V3, Kimi-K2.5); its KV cache has the target's format.
    architecture: Literal["llama", "mla"] = "llama"
    # Decoder layers of the draft (EAGLE-3: 1; vLLM serves one).
    num_layers: int = 1
    # null = copied from the target config.json.
    num_attention_heads: int | None = None
    # null = copied from the target config.json.
    num_key_value_heads: int | None = None
    # null = copied from the target config.json.
    head_dim: int | None = None
    # MLA only (null = copied from the target config.json / dataset): vLLM needs q_lora_rank
    # set, and kv_lora_rank + qk_rope_head_dim in {320, 512, 576} (576 on CPU).
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # The draft MLP's width; null = the target's.
    intermediate_size: int | None = None
    # The draft's own norms' epsilon; null = the target's.
    rms_norm_eps: float | None = None
    # null = copied from the target config.json.
    max_position_embeddings: int | None = None
    # null = copied from the target config.json.
    rope_theta: float | None = None
    # RoPE scaling as in the target's config (rope_parameters / rope_scaling); null = copied.
    rope_scaling: dict[str, Any] | None = None
    # Norm options vLLM and speculators understand (see model/draft.py for what each does).
    # norm_before_residual: the residual of layer 0 is the normed input, so the state fed back
    # at TTT steps >= 1 (whose scale drifts) cannot dominate it. Measured by vLLM on the tiny
    # recipe (tools/bench/bench_vs_speculators.py): acceptance length 2.93 without, 3.12 with.
    # It is also what vLLM assumes when a speculators config omits the key.
    norm_before_residual: bool = True
    # norm_before_fc: one RMSNorm over the concatenated aux states before fc (gpt-oss style;
    # Llama-style draft only: vLLM's MLA draft has no such norm).
    norm_before_fc: bool = False
    # fc_norm (EAGLE 3.1): one RMSNorm per aux state before their concatenation and fc, so
    # no captured layer's scale dominates fc's input; exclusive with norm_before_fc (as in
    # speculators). Both draft kinds.
    fc_norm: bool = False
    # norm_output: the state fed to the next TTT step is the final norm's output, not the
    # pre-norm residual, so its scale cannot drift with speculation depth.
    norm_output: bool = False
    # EAGLE-3's paper trains the draft's LM head (initialised from the target's rows);
    # speculators 0.9.0 keeps it frozen. Measured by vLLM on the tiny recipe: 3.12 frozen,
    # 3.17 trained.
    train_lm_head: bool = True
    # The TTT attention (causal+document keys plus the per-slot diagonal of earlier TTT
    # steps; attention.py, flash_attention.py). "chunked": the exact reference in plain torch,
    # memory O(T·chunk). "flash": FlashAttention varlen over the step-0 keys with the
    # diagonal merged in closed form (CUDA bf16/fp16; on CPU torch's flash kernel with a dense
    # mask). "sdpa": one dense mask over all steps' keys (as speculators does, O(T²·k)
    # memory). "auto": flash on CUDA in bf16, chunked otherwise.
    attention: Literal["auto", "chunked", "flash", "sdpa"] = "auto"
    # Query rows per chunk of the chunked attention.
    attention_chunk: int = 512
    # Tokens per chunk of the fused LM-head + KL (draft logits exist one chunk at a time).
    loss_chunk: int = 1024
    # Start from a published draft (a directory in the speculators eagle3 or vLLM-native MLA
    # layout, as eagle3-train exports): its weights replace the random start. Its
    # architecture, hidden size, aux layer ids and target vocabulary must match this run's
    # (refused before any step otherwise); its fingerprint goes into the new draft's lineage.
    init_from: str | None = None
    # With init_from: when the draft's d2t differs from this run's vocabulary map, carry over
    # the LM-head rows of the target tokens both vocabularies hold (the others start from the
    # target's rows) instead of refusing.
    remap_vocab: bool = False


@dataclass
class DataConfig:
    # The hidden-state dataset (eagle3-extract's output directory; with `data.stream`, the stream's
    # OUT).
    hidden_states: str = ""
    # The vocabulary map (eagle3-data vocab's safetensors file).
    vocab_map: str = ""
    # Share of samples held out for validation, chosen by a hash of the sample id (stable
    # across runs, world sizes and seeds).
    validation_fraction: float = 0.02
    # Packed tokens per micro-batch (one packed sequence; longer samples keep their prefix).
    max_tokens_per_batch: int = 2048
    # Loader processes (0 = read in the training process).
    num_workers: int = 1
    # Batches each loader worker prepares ahead.
    prefetch_batches: int = 2
    # Cap on validation batches per run of validation; null = the whole validation split.
    max_validation_batches: int | None = None
    # Sample order of an epoch (eagle3_train/data/order.py). "global": all training samples
    # shuffled by (seed, epoch), then packed. "shard_window": windows of `window_shards`
    # consecutive shards in the extraction's order, each shuffled by (seed, epoch, window) and
    # packed on its own; validation then uses the held-out samples of window 0. A stream needs
    # it; a finished dataset trained in this order gets the same batches as the stream.
    order: Literal["global", "shard_window"] = "global"
    # Consecutive shards per window under `data.order: shard_window`.
    window_shards: int = 4
    # shard_window: train each window this many times (reshuffled each pass) before the next.
    # The retained-window way to several passes over a stream whose shards are reclaimed:
    # disk stays at the budget and extraction runs once, but a sample's repeats come close
    # together instead of an epoch apart (the other way: eagle3-extract --epochs).
    window_passes: int = 1
    # Train on a stream while `eagle3-extract run --stream --out OUT` writes it:
    # hidden_states names OUT, the shards are read from OUT.partial as they are sealed.
    stream: bool = False
    # With stream (CLI --reclaim): once a checkpoint covers a window, write receipts and delete
    # its shards, so the producer can go on under its --disk-budget. Several epochs then need
    # the stream extracted once per epoch (eagle3-extract --epochs) or data.window_passes.
    reclaim: bool = False
    # With stream: stop when the producer seals no shard for this long.
    stream_timeout_s: float = 3600.0
    # Hash each sample's rows as the loader reads them and compare with the manifest's
    # checksum (XXH3-128 for schema v2). Measured cost: see tools/bench/bench_train.py --verify-rows.
    verify_rows: bool = True
    # A sample whose rows do not match: "stop" (exit 6, naming shard, sample and rows) or
    # "skip" (the sample adds nothing to the step; a "corrupt" event in metrics.jsonl, counted
    # as corrupt_samples in the train log and the done event).
    on_corrupt: Literal["stop", "skip"] = "stop"


@dataclass
class CardConfig:
    """The model card (README.md) written beside the export: what the Hub shows."""

    # Hub id the draft will be published as; the card's `vllm serve` command names it.
    # null = the draft's local directory.
    repo_id: str | None = None
    # Hub id of the target (front matter base_model). null = target.name_or_path.
    base_model: str | None = None
    license: str | None = None  # e.g. apache-2.0, other; null = not stated
    datasets: list[str] = field(default_factory=list)  # Hub ids of the training data
    # The card's `language` front matter (e.g. [en]).
    language: list[str] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)  # added to eagle3, speculative-decoding, ...
    # Extra words for the card's `vllm serve` line, e.g. ["--tensor-parallel-size", "8"].
    serve_args: list[str] = field(default_factory=list)


@dataclass
class ExportConfig:
    # The exported weights' dtype.
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    # Also export the target's embedding rows into the draft (vLLM shares the target's; off keeps
    # the checkpoint small).
    include_embeddings: bool = False
    # The `speculative_tokens` hint of the export's config.json and the card's `vllm serve`
    # line: the k vLLM is meant to serve the draft with (its num_speculative_tokens). Not
    # train.ttt_steps: a run may unroll more TTT steps than it serves.
    speculative_tokens: int = 3
    # The published layout: "speculators" (OUTPUT/draft: the speculators eagle3 config, or
    # vLLM's native MLA config), "sglang" (OUTPUT/draft-sglang: the SpecForge / SGLang layout
    # SGLang's LlamaForCausalLMEagle3 loads; Llama-style one-layer drafts trained with
    # norm_before_residual false and no fc_norm / norm_before_fc / norm_output), or "both".
    # exports/step-N stay in the speculators layout (validated) whatever this says.
    format: Literal["speculators", "sglang", "both"] = "speculators"
    card: CardConfig = field(default_factory=CardConfig)


@dataclass
class Config:
    # The run's directory: checkpoints, `run.yaml`, `metrics.jsonl`, the export (`draft/`,
    # `exports/step-N/`). An existing one is resumed (`train.resume`).
    output_dir: str = "runs/eagle3"
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    export: ExportConfig = field(default_factory=ExportConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------
# Loading


def parse_override(text: str) -> dict[str, Any]:
    """``a.b.c=value`` (value parsed as YAML) as a nested mapping."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.lr=3e-4")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    # ValueError: an integer past Python's 4300 digits; RecursionError: nesting past the parser's
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from e
    node: dict[str, Any] = {}
    cursor = node
    parts = key.strip().split(".")
    for part in parts[:-1]:
        cursor[part] = {}
        cursor = cursor[part]
    cursor[parts[-1]] = value
    return node


def load_config(
    path: str | Path | None = None, overrides: list[dict[str, Any]] | None = None
) -> Config:
    """Defaults < the YAML file at ``path`` < each override, validated."""
    data: dict[str, Any] = {}
    where = "config"
    if path is not None:
        path = Path(path)
        where = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file ({e})") from e
        # ValueError: not UTF-8, or an integer past Python's 4300 digits; RecursionError: nesting
        except (yaml.YAMLError, ValueError, RecursionError) as e:
            raise ConfigError(f"{path}: not valid UTF-8 YAML ({e})") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, found {type(loaded).__name__}")
        data = loaded or {}
        # Relative data/target paths in a config file are relative to the working directory
        # (the README runs everything from the repository root), as in speculators' recipes.
    for override in overrides or []:
        data = merge(data, override)
    config = build(Config, data, "")
    problems = check_config(config)
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    return config


def check_config(config: Config) -> list[str]:
    """Values that are well-typed but cannot make a run."""
    t, d, data = config.train, config.draft, config.data
    o, m = t.objective, t.muon
    # Counts with a least value: "train.epochs: 0 < 1".
    least = {
        "train.ttt_steps": (t.ttt_steps, 1),
        "train.objective.topk": (o.topk, 1),
        "train.gradient_accumulation_steps": (t.gradient_accumulation_steps, 1),
        "train.muon.ns_steps": (m.ns_steps, 1),
        "train.epochs": (t.epochs, 1),
        "train.max_skips_in_row": (t.max_skips_in_row, 1),
        "train.log_every": (t.log_every, 1),
        "train.save_every": (t.save_every, 0),
        "data.max_tokens_per_batch": (data.max_tokens_per_batch, 2),
        "data.num_workers": (data.num_workers, 0),
        "data.window_shards": (data.window_shards, 1),
        "data.window_passes": (data.window_passes, 1),
        "draft.num_layers": (d.num_layers, 1),
    }
    p = [f"{key}: {value} < {n}" for key, (value, n) in least.items() if value < n]
    if not data.hidden_states:
        p.append("data.hidden_states: required (the hidden-state dataset directory)")
    if not data.vocab_map:
        p.append("data.vocab_map: required (the vocab_map .safetensors of eagle3-data)")
    if not 0 < t.ttt_step_loss_decay <= 1:
        p.append(f"train.ttt_step_loss_decay: {t.ttt_step_loss_decay} not in (0, 1]")
    if o.lk_eta < 0:
        p.append(f"train.objective.lk_eta: {o.lk_eta} must be >= 0")
    if o.topk_weight < 0:
        p.append(f"train.objective.topk_weight: {o.topk_weight} must be >= 0")
    if t.lr <= 0:
        p.append(f"train.lr: {t.lr} must be > 0")
    if not 0 <= t.min_lr_ratio <= 1:
        p.append(f"train.min_lr_ratio: {t.min_lr_ratio} not in [0, 1]")
    if t.hidden_noise < 0:
        p.append(f"train.hidden_noise: {t.hidden_noise} must be >= 0 (0 = no noise)")
    if m.lr is not None and m.lr <= 0:
        p.append(f"train.muon.lr: {m.lr} must be > 0")
    if m.momentum < 0 or m.weight_decay < 0 or m.adamw_weight_decay < 0:
        p.append("train.muon.momentum, weight_decay and adamw_weight_decay must be >= 0")
    elif m.momentum >= 1:
        p.append(f"train.muon.momentum: {m.momentum} must be in [0, 1)")
    if len(t.betas) != 2:
        p.append(f"train.betas: expected two numbers, found {t.betas}")
    elif not all(0 <= b < 1 for b in t.betas):
        p.append(f"train.betas: {t.betas} must each be in [0, 1)")
    if t.weight_decay < 0:
        p.append(f"train.weight_decay: {t.weight_decay} must be >= 0")
    if t.adam_eps <= 0:
        p.append(f"train.adam_eps: {t.adam_eps} must be > 0")
    if t.max_grad_norm < 0:
        p.append(f"train.max_grad_norm: {t.max_grad_norm} must be >= 0 (0 = no clip)")
    if t.warmup_steps < 0:
        p.append(f"train.warmup_steps: {t.warmup_steps} must be >= 0")
    for key, eps in (
        ("target.rms_norm_eps", config.target.rms_norm_eps),
        ("draft.rms_norm_eps", d.rms_norm_eps),
        ("draft.rope_theta", d.rope_theta),
    ):
        if eps is not None and eps <= 0:
            p.append(f"{key}: {eps} must be > 0")
    if t.max_steps is not None and t.max_steps < 1:
        p.append(f"train.max_steps: {t.max_steps} < 1")
    try:
        parse_signals(t.preempt_signals, "train.preempt_signals")
    except ValueError as e:
        p.append(str(e))
    if t.collective_timeout_s <= 0:
        p.append(f"train.collective_timeout_s: {t.collective_timeout_s} must be > 0")
    for tracker in t.trackers:
        if tracker not in ("tensorboard", "wandb", "none"):
            p.append(f"train.trackers: {tracker!r} is not one of tensorboard, wandb, none")
    if not 0 <= data.validation_fraction < 1:
        p.append(f"data.validation_fraction: {data.validation_fraction} not in [0, 1)")
    if data.stream and data.order != "shard_window":
        p.append(
            "data.stream: a stream is read window by window; set data.order: shard_window "
            f"(found {data.order!r})"
        )
    if data.reclaim and not data.stream:
        p.append("data.reclaim: deletes shards of a stream only; set data.stream: true")
    if data.window_passes > 1 and data.order != "shard_window":
        p.append("data.window_passes: passes over a window need data.order: shard_window")
    if data.stream_timeout_s <= 0:
        p.append(f"data.stream_timeout_s: {data.stream_timeout_s} must be > 0")
    if config.export.speculative_tokens < 1:
        p.append(
            f"export.speculative_tokens: {config.export.speculative_tokens} < 1 (the number of "
            "tokens vLLM proposes per step, e.g. 3)"
        )
    if config.export.format not in ("speculators", "sglang", "both"):
        p.append(
            f"export.format {config.export.format!r}: expected 'speculators', 'sglang' or 'both'"
        )
    if d.architecture not in ("llama", "mla"):
        p.append(f"draft.architecture {d.architecture!r}: expected 'llama' or 'mla'")
    if d.architecture == "mla" and d.norm_before_fc:
        p.append("draft.norm_before_fc: vLLM's MLA draft has no input norm before fc")
    if d.fc_norm and d.norm_before_fc:
        p.append(
            "draft.fc_norm and draft.norm_before_fc: two norms of fc's input, choose one "
            "(fc_norm: one per aux layer, EAGLE 3.1; norm_before_fc: one over the concatenation)"
        )
    if d.attention_chunk < 1 or d.loss_chunk < 1:
        p.append("draft.attention_chunk and draft.loss_chunk must be >= 1")
    if d.aux_layer_ids is not None and (
        not d.aux_layer_ids or sorted(set(d.aux_layer_ids)) != d.aux_layer_ids
    ):
        p.append(f"draft.aux_layer_ids: {d.aux_layer_ids} must be non-empty, sorted and unique")
    return p


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)
