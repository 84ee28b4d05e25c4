"""Sizing a job before it exists: ``eagle3-extract plan`` — disk, GPU memory, parallelism.

Before the data is even regenerated, a recipe asks whether its sizes fit the machine: the
hidden states of N planned tokens on the output disk, the target's weights per GPU under a
tensor/pipeline-parallel layout, and whether that layout divides the model (attention heads,
routed experts, quantization groups). Everything comes from ``config.json`` (and the
checkpoint's safetensors headers when the weights are there), so the figures of a resource
sheet are this arithmetic on the real config, not prose.

Weights: the exact byte count of the safetensors headers when the files are present; otherwise
a parameter count from the config (Llama/Qwen dense GQA, DeepSeek-V3/Kimi MLA + MoE) with the
config's compressed-tensors quantization applied to the modules it does not ignore.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_extract.plan import bytes_per_token
from eagle3_extract.preflight import DISK_HEADROOM, Finding, disk_need, free_space
from eagle3_extract.target import TargetInfo
from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_schemas.layouts.target_config import kv_cache_bytes_per_token, text_config

BF16 = 2
GIB = 2**30
# Below this share of the usable GPU memory left after the weights, a layout is flagged tight.
TIGHT_SHARE = 0.10


@dataclass(frozen=True)
class ModuleGroup:
    """Parameters of one kind of module, with a representative module name (for ignore rules)."""

    kind: str
    example: str  # a module name as the checkpoint has it (quantization ignore patterns)
    params: int
    linear: bool = True  # quantization configs target Linear layers only


@dataclass
class PlanInputs:
    model: Path
    aux_layer_ids: list[int]
    storage_dtype: str = "bfloat16"
    num_tokens: int = 0
    num_samples: int = 0
    # num_tokens is an upper bound (samples x their length cap), not an estimate: a bound
    # over the free disk is a warning — extract's preflight checks the exact count later.
    tokens_are_bound: bool = False
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpus: int | None = None
    gpu_memory_gib: float | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    out: Path | None = None


@dataclass
class Plan:
    findings: list[Finding] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def add(self, level: str, check: str, message: str) -> None:
        self.findings.append(Finding(level, check, message))

    @property
    def ok(self) -> bool:
        return not any(f.level == "error" for f in self.findings)


# ---- parameters from the config ------------------------------------------------------------


def module_groups(config: dict[str, Any]) -> list[ModuleGroup]:
    """The decoder's parameters by module kind, from config.json alone."""
    t = text_config(config)
    h, layers, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    heads = t["num_attention_heads"]
    if "kv_lora_rank" in t:  # MLA (DeepSeek-V3, Kimi-K2.5)
        q_dim = t["qk_nope_head_dim"] + t["qk_rope_head_dim"]
        q = (
            h * t["q_lora_rank"] + t["q_lora_rank"] * heads * q_dim
            if t.get("q_lora_rank")
            else h * heads * q_dim
        )
        kv = h * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) + t["kv_lora_rank"] * heads * (
            t["qk_nope_head_dim"] + t["v_head_dim"]
        )
        attention = q + kv + heads * t["v_head_dim"] * h
    else:
        head_dim = t.get("head_dim") or h // heads
        kv_heads = t.get("num_key_value_heads") or heads
        attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
    experts = t.get("n_routed_experts") or t.get("num_experts") or 0
    dense_layers = min(t.get("first_k_dense_replace", 0 if experts else layers), layers)
    moe_layers = layers - dense_layers if experts else 0
    dense = 3 * h * t["intermediate_size"] if dense_layers else 0
    moe = 3 * h * (t.get("moe_intermediate_size") or t["intermediate_size"]) if moe_layers else 0
    shared = t.get("n_shared_experts") or 0
    tied = t.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    groups = [
        ModuleGroup("embed_tokens", "model.embed_tokens", vocab * h, linear=False),
        ModuleGroup("lm_head", "lm_head", 0 if tied else vocab * h),
        ModuleGroup("attention", "model.layers.1.self_attn.q_proj", layers * attention),
        ModuleGroup("dense_mlp", "model.layers.0.mlp.gate_proj", dense_layers * dense),
        ModuleGroup("router", "model.layers.1.mlp.gate", moe_layers * experts * h, linear=False),
        ModuleGroup(
            "routed_experts", "model.layers.1.mlp.experts.0.gate_proj", moe_layers * experts * moe
        ),
        ModuleGroup(
            "shared_experts",
            "model.layers.1.mlp.shared_experts.gate_proj",
            moe_layers * shared * moe,
        ),
    ]
    return [g for g in groups if g.params]  # the kinds this model has


def _ignored(name: str, patterns: list[str]) -> bool:
    return any(
        re.match(p[3:], name) if p.startswith("re:") else name == p or name.endswith("." + p)
        for p in patterns
    )


def _quantization(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The quantization_config (top level or in text_config) and its first group's weights."""
    quant = config.get("quantization_config") or text_config(config).get("quantization_config")
    quant = quant or {}
    groups = list((quant.get("config_groups") or {}).values())
    return quant, (groups[0].get("weights") or {}) if groups else {}


def quantized_bytes_per_param(config: dict[str, Any]) -> tuple[float, list[str]] | None:
    """Bytes per weight of the quantized modules (bits/8 + one bf16 scale per group) and the
    ignore patterns, for a compressed-tensors config; None for unquantized checkpoints."""
    quant, weights = _quantization(config)
    bits, group = weights.get("num_bits"), weights.get("group_size")
    if not bits:
        return None
    per_param = bits / 8 + (BF16 / group if group else 0)
    return per_param, list(quant.get("ignore") or [])


def weight_bytes_from_config(config: dict[str, Any]) -> tuple[int, dict[str, int]]:
    quant = quantized_bytes_per_param(config)
    by_kind: dict[str, int] = {}
    for g in module_groups(config):
        quantized = quant is not None and g.linear and not _ignored(g.example, quant[1])
        by_kind[g.kind] = round(g.params * (quant[0] if quantized else BF16))
    return sum(by_kind.values()), by_kind


def weight_bytes_from_files(model: Path) -> int | None:
    files = sorted(model.glob("*.safetensors"))
    if not files:
        return None
    return sum(t.end - t.start for f in files for t in read_safetensors(f).tensors.values())


# ---- the plan -------------------------------------------------------------------------------


def check_parallelism(
    config: dict[str, Any], tp: int, pp: int, gpus: int | None, plan: Plan
) -> None:
    t = text_config(config)
    problems = []
    heads = t["num_attention_heads"]
    if heads % tp:
        problems.append(f"{heads} attention heads do not split over tensor_parallel_size {tp}")
    if t["num_hidden_layers"] < pp:
        problems.append(f"{t['num_hidden_layers']} layers cannot fill {pp} pipeline stages")
    experts = t.get("n_routed_experts") or t.get("num_experts") or 0
    notes = [f"{heads / tp:g} heads per GPU"]
    if experts:
        moe = t.get("moe_intermediate_size") or t["intermediate_size"]
        if moe % tp:
            problems.append(
                f"moe_intermediate_size {moe} does not split over tensor_parallel_size {tp}"
            )
        group = _quantization(config)[1].get("group_size")
        if group and not moe % tp and (moe // tp) % group:
            problems.append(
                f"each GPU's slice of an expert ({moe // tp} columns) is not a whole number of "
                f"quantization groups of {group}"
            )
        notes.append(f"each of {experts} routed experts split {moe} -> {moe // tp} per GPU")
        if experts % tp:
            notes.append(f"expert parallelism needs experts % {tp} == 0 (it is {experts % tp})")
    if gpus is not None and tp * pp > gpus:
        problems.append(f"tensor x pipeline = {tp * pp} GPUs, the node has {gpus}")
    if problems:
        plan.add("error", "parallelism", "; ".join(problems))
    else:
        plan.add("ok", "parallelism", f"TP {tp} x PP {pp}: " + "; ".join(notes))


def make_plan(inputs: PlanInputs, target: TargetInfo) -> Plan:
    config = json.loads((inputs.model / "config.json").read_text(encoding="utf-8"))
    plan = Plan()
    tp, pp = inputs.tensor_parallel_size, inputs.pipeline_parallel_size
    check_parallelism(config, tp, pp, inputs.gpus, plan)

    from_files = weight_bytes_from_files(inputs.model)
    estimated, by_kind = weight_bytes_from_config(config)
    weights = from_files if from_files is not None else estimated
    source = "safetensors headers" if from_files is not None else "config.json arithmetic"
    per_gpu = weights / (tp * pp)
    kv_per_token = kv_cache_bytes_per_token(config, tp)
    plan.figures.update(
        weight_bytes=weights,
        weight_bytes_source=source,
        weight_bytes_by_kind=by_kind,
        weight_bytes_per_gpu=round(per_gpu),
        kv_cache_bytes_per_token_per_gpu=kv_per_token,
    )
    text = f"weights {weights / 1e9:.1f} GB ({source}), {per_gpu / 1e9:.1f} GB per GPU at TP {tp} x PP {pp}"
    if inputs.gpu_memory_gib is None:
        plan.add("ok", "gpu memory", text + " (give --gpu-memory-gib to check a GPU)")
    else:
        budget = inputs.gpu_memory_gib * GIB * inputs.gpu_memory_utilization
        room = budget - per_gpu
        sequence = kv_per_token * (inputs.max_model_len or 0)
        plan.figures.update(gpu_budget_bytes=round(budget), kv_cache_room_bytes=round(room))
        text += (
            f"; {inputs.gpu_memory_gib:g} GiB x {inputs.gpu_memory_utilization:g} = "
            f"{budget / 1e9:.1f} GB usable per GPU"
        )
        if room <= sequence or room <= 0:
            need = (
                f"{sequence / 1e9:.2f} GB for one {inputs.max_model_len}-token sequence"
                if sequence
                else "room"
            )
            plan.add(
                "error",
                "gpu memory",
                text + f": {room / 1e9:.1f} GB left for the KV cache, "
                f"which needs {need}: use more GPUs (TP/PP) or larger ones",
            )
        else:
            tokens = int(room // kv_per_token)
            # vLLM also keeps activations and CUDA graphs beside the KV cache: a few GB.
            level = "warning" if room < TIGHT_SHARE * budget else "ok"
            tight = (
                " (tight: activations and CUDA graphs need a few GB of it)"
                if level == "warning"
                else ""
            )
            plan.add(
                level,
                "gpu memory",
                text + f"; {room / 1e9:.1f} GB left: KV cache for ~{tokens:,} tokens "
                f"({kv_per_token:,} B/token/GPU){tight}",
            )

    n_aux, storage = len(inputs.aux_layer_ids), inputs.storage_dtype
    per_token = bytes_per_token(n_aux, target.hidden_size, storage)
    disk = disk_need(target, n_aux, storage, inputs.num_tokens, inputs.num_samples)
    plan.figures.update(
        bytes_per_token=per_token,
        gb_per_million_tokens=per_token / 1e3,
        num_tokens=inputs.num_tokens,
        disk_bytes=disk,
    )
    text = (
        f"{per_token:,} B/token ({len(inputs.aux_layer_ids)} aux + last, H {target.hidden_size}, "
        f"{inputs.storage_dtype}) x {inputs.num_tokens:,} tokens = {disk / 1e12:.2f} TB"
    )
    if inputs.out is None:
        plan.add("ok", "disk", text + " (give --out to check the disk)")
    else:
        probe, free = free_space(inputs.out)
        plan.figures["disk_free_bytes"] = free
        text += f"; {free / 1e12:.2f} TB free at {probe}"
        if disk > free * (1 - DISK_HEADROOM) and inputs.tokens_are_bound:
            plan.add(
                "warning",
                "disk",
                text + ": the upper bound does not fit; extract's preflight checks the exact "
                "token count before writing",
            )
        elif disk > free * (1 - DISK_HEADROOM):
            plan.add(
                "error", "disk", text + " (fp8_e4m3 storage halves it; or extract fewer tokens)"
            )
        else:
            plan.add("ok", "disk", text)
    return plan
