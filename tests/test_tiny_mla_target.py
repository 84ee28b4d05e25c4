"""The embedded MLA + MoE target (recipes/tiny-mla/target): Kimi-K2.5's layout, really trained.

tools/targets/build_tiny_mla_target.py trains it on the tiny target's corpus with the tiny
target's tokenizer and ships it in the Kimi wrapper's checkpoint layout. These tests read the
shipped directory as the stages do (the config through eagle3-schemas, the model through
eagle3-eval's loader, i.e. transformers' own wrapper class) and check on held-out data that it
learned something, so that drafts measured on it are judged against a target that predicts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import PreTrainedTokenizerFast

from eagle3_eval.target import load_target
from eagle3_schemas.layouts.target_config import text_config

from support import tiny_corpus, tiny_target

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "recipes" / "tiny-mla" / "target"
KIMI_RECIPE = ROOT / "recipes" / "kimi-k2.5"
# What the builder copies from the tiny target (tools/targets/build_tiny_mla_target.py).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((TARGET / "config.json").read_text())


@pytest.fixture(scope="module")
def build_info() -> dict:
    return json.loads((TARGET / tiny_target.BUILD_INFO).read_text())


def test_the_wrapper_and_the_backbone_are_kimis(config: dict) -> None:
    real = json.loads((KIMI_RECIPE / "target_config.json").read_text())
    text = text_config(config)
    assert config["architectures"] == real["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert (config["model_type"], text["model_type"]) == ("kimi_k25", "kimi_k2")
    # MLA at the real latent sizes (vLLM's CPU backend runs only 512 + 64), the real YaRN RoPE.
    for key in ("kv_lora_rank", "qk_rope_head_dim", "rope_scaling", "rope_theta"):
        assert text[key] == real["text_config"][key], key
    # First layer dense, then MoE with top-k routed experts and a shared one, noaux_tc sigmoid.
    for key in ("first_k_dense_replace", "n_shared_experts", "topk_method", "scoring_func"):
        assert text[key] == real["text_config"][key], key
    assert (text["n_routed_experts"], text["num_experts_per_tok"]) == (8, 2)
    assert text["num_hidden_layers"] == 7  # Kimi's [2, N//2, N-3] aux ids are [2, 3, 4]
    with safe_open(str(TARGET / "model.safetensors"), "pt") as weights:
        names = list(weights.keys())
        dtypes = {weights.get_slice(n).get_dtype() for n in names}
    assert all(n.startswith("language_model.") for n in names)
    assert "language_model.model.layers.1.mlp.experts.7.down_proj.weight" in names
    assert dtypes == {"BF16"}


def test_it_shares_the_tiny_targets_tokenizer_and_heldout_files(
    config: dict, build_info: dict
) -> None:
    for name in TOKENIZER_FILES:
        assert (TARGET / name).read_bytes() == (tiny_target.TARGET_DIR / name).read_bytes(), name
    tiny_info = json.loads((tiny_target.TARGET_DIR / tiny_target.BUILD_INFO).read_text())
    assert build_info["heldout_sources"] == tiny_info["heldout_sources"]
    assert build_info["corpus_fingerprint"] == tiny_info["corpus_fingerprint"]
    assert text_config(config)["vocab_size"] == tiny_info["vocab_size"] == 4096
    assert config["eos_token_id"] == text_config(config)["eos_token_id"] == 2  # <|im_end|>


def test_the_shipped_target_is_small(build_info: dict) -> None:
    size = sum(p.stat().st_size for p in TARGET.iterdir() if p.is_file())
    assert size < 30 * 2**20
    assert build_info["parameters"] < 13_000_000


def test_heldout_answer_ce_is_far_below_unigram(build_info: dict) -> None:
    torch.set_num_threads(2)
    model = load_target(TARGET, dtype="float32").model  # as eagle3-eval loads a target
    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        tiny_target.TARGET_DIR, local_files_only=True
    )
    heldout = [c for c in tiny_corpus.build_corpus() if c.split == "heldout"]
    ce, n_tokens = tiny_target.heldout_answer_ce(model, tokenizer, heldout, 50)
    assert n_tokens > 2000
    assert ce < build_info["check_max_ce"]
    assert ce < build_info["unigram_heldout_answer_ce"] - 1.0
