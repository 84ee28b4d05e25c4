"""Shared fixtures of the eagle3-extract tests: tiny real targets (random weights) and inputs.

The targets are real transformers models of the three architecture families extraction must
handle (Llama; Qwen3 with per-head q/k norms; DeepseekV3 with MLA attention and MoE layers),
shrunk so a forward pass takes milliseconds. Weights are float32 so the reference is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    PretrainedConfig,
    Qwen3Config,
)

from support import fixtures

VOCAB = 64  # > fixtures.V_TARGET (32): the fixture's token ids fit


def _config(arch: str, hidden: int, layers: int) -> PretrainedConfig:
    common = {
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    if arch == "llama":
        return LlamaConfig(
            intermediate_size=2 * hidden, num_attention_heads=4, num_key_value_heads=2, **common
        )
    if arch == "qwen3":
        return Qwen3Config(
            intermediate_size=2 * hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            **common,
        )
    if arch == "deepseek_v3":
        return DeepseekV3Config(
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2,
            num_attention_heads=2,
            num_key_value_heads=2,
            q_lora_rank=24,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            scoring_func="sigmoid",
            **common,
        )
    raise ValueError(arch)


def build_target(
    directory: Path, arch: str = "llama", hidden: int = 32, layers: int = 4, seed: int = 0
) -> Path:
    """Save a tiny random-weight target of ``arch`` (float32 safetensors) to ``directory``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, hidden, layers), dtype=torch.float32)
    # Random init leaves norms at 1: perturb them so a pre/post-norm mix-up cannot hide.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(autouse=True, scope="module")
def _torch_threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def target_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    cache: dict[tuple, Path] = {}

    def make(arch: str = "llama", hidden: int = 32, layers: int = 4, seed: int = 0) -> Path:
        key = (arch, hidden, layers, seed)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{arch}-h{hidden}-l{layers}-s{seed}")
            cache[key] = build_target(directory, arch, hidden, layers, seed)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_target(target_factory: Callable[..., Path]) -> Path:
    return target_factory("llama")


@pytest.fixture
def tokenized(tmp_path: Path) -> Path:
    """Eight samples of 3-17 tokens (schema tokenized v1, token ids < 32)."""
    return fixtures.tokenized(tmp_path / "tokenized.parquet", lengths=(5, 9, 7, 12, 3, 17, 8, 6))


REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_TARGET = REPO_ROOT / "recipes" / "tiny" / "target"


def stdlib_chats(count: int) -> list[list[dict[str, str]]]:
    """Chat conversations made from standard-library functions (request, then its source)."""
    import inspect
    import json as json_module
    import textwrap

    functions = [
        f
        for module in (textwrap, json_module.decoder, inspect)
        for _, f in sorted(vars(module).items())
        if inspect.isfunction(f) and f.__module__ == module.__name__ and f.__doc__
    ]
    chats = []
    for f in functions[:count]:
        source = inspect.getsource(f)[:1200]
        first = f.__doc__.strip().splitlines()[0]
        chats.append(
            [
                {"role": "user", "content": f"Write a Python function `{f.__name__}` that {first}"},
                {"role": "assistant", "content": source},
            ]
        )
    return chats


def _write_chat_tokenized(tokenizer_dir: Path, path: Path, count: int = 16) -> Path:
    """A real tokenized artifact: chats rendered with the target's template, answer-only mask."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    from eagle3_schemas.contract.header import make_header, write_parquet
    from eagle3_schemas.contract.lineage import (
        fingerprint_json,
        fingerprint_text,
        fingerprint_tokenizer_dir,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    chats = stdlib_chats(count)
    ids, masks = [], []
    for chat in chats:
        enc = tokenizer.apply_chat_template(
            chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids.append(list(enc["input_ids"]))
        masks.append(list(enc["assistant_masks"]))
    table = pa.table(
        {
            "id": [f"chat-{i:04d}" for i in range(len(chats))],
            "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
            "loss_mask": pa.array(masks, type=pa.list_(pa.uint8())),
            "num_tokens": pa.array([len(x) for x in ids], type=pa.int32()),
            "num_loss_tokens": pa.array([sum(m) for m in masks], type=pa.int32()),
        }
    )
    lineage = {
        "conversations_fingerprint": fingerprint_json(chats),
        "tokenizer_fingerprint": fingerprint_tokenizer_dir(tokenizer_dir),
        "chat_template_fingerprint": fingerprint_text(tokenizer.chat_template or ""),
    }
    header = make_header(
        "tokenized", lineage, vocab_size=len(tokenizer), max_length=2048, truncation="keep_prefix"
    )
    write_parquet(path, table, header)
    return path


@pytest.fixture(scope="session")
def write_chat_tokenized() -> Callable[..., Path]:
    """``(tokenizer_dir, path, count)`` -> a tokenized artifact of stdlib chats."""
    return _write_chat_tokenized
