"""The embedded default target (recipes/tiny/target) and the tiny random-weight targets.

The shipped target is a small Llama trained by tools/targets/build_tiny_target.py on conversations made
from the Python standard library. These tests load it as any Hugging Face model directory, check
its chat template to the character, and check on held-out data that it really learned something.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from support import random_targets, tiny_corpus, tiny_target
from support.vllm_server import SERVED_NAME

REPO_ROOT = Path(__file__).resolve().parents[3]
TARGET_DIR = REPO_ROOT / "recipes" / "tiny" / "target"


@pytest.fixture(scope="module", autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def corpus() -> list:
    return tiny_corpus.build_corpus()


@pytest.fixture(scope="module")
def heldout(corpus: list) -> list:
    return [c for c in corpus if c.split == "heldout"]


@pytest.fixture(scope="module")
def target() -> tuple:
    return tiny_target.load_target(TARGET_DIR)


@pytest.fixture(scope="module")
def build_info() -> dict:
    return json.loads((TARGET_DIR / tiny_target.BUILD_INFO).read_text())


# --- The shipped directory ---------------------------------------------------------------------


def test_shipped_target_loads_with_transformers_auto_classes() -> None:
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        TARGET_DIR, local_files_only=True, dtype=torch.float32
    )
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer) == 4096
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == im_end
    assert model.generation_config.eos_token_id == im_end
    assert not model.config.tie_word_embeddings
    assert next(model.parameters()).dtype == torch.float32


def test_shipped_target_is_small(build_info: dict) -> None:
    size = sum(p.stat().st_size for p in TARGET_DIR.iterdir() if p.is_file())
    assert size < 25 * 2**20
    config = AutoConfig.from_pretrained(TARGET_DIR, local_files_only=True)
    assert config.num_hidden_layers == 6
    assert build_info["parameters"] < 7_000_000


def test_chat_template_renders_exact_chatml() -> None:
    tokenizer = AutoTokenizer.from_pretrained(TARGET_DIR, local_files_only=True)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    full = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "def f():\n    return 1\n"},
            {"role": "user", "content": "again"},
        ],
        tokenize=False,
    )
    assert full == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\ndef f():\n    return 1\n<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
    )


def test_encoding_and_answer_mask_match_the_chat_template(target: tuple, heldout: list) -> None:
    """encode() (used for training and evaluation) equals the template's tokens and the
    {% generation %} assistant mask, and its prompt part equals the served prompt."""
    _, tokenizer = target
    for conv in tiny_corpus.check_subset(heldout, 5):
        encoded = tiny_target.encode(tokenizer, conv)
        rendered = tokenizer.apply_chat_template(
            conv.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert encoded.ids == rendered["input_ids"]
        assert encoded.answer_mask == rendered["assistant_masks"]
        prompt = tokenizer.apply_chat_template(
            conv.messages[:1], tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        assert encoded.ids[: len(prompt)] == prompt
        assert sum(encoded.answer_mask[: len(prompt)]) == 0


# --- The corpus --------------------------------------------------------------------------------


def test_heldout_split_shares_no_file_and_no_code_with_train(corpus: list) -> None:
    train = [c for c in corpus if c.split == "train"]
    heldout = [c for c in corpus if c.split == "heldout"]
    assert len(heldout) > 100 and len(train) > 10 * len(heldout)
    assert not {c.source for c in train} & {c.source for c in heldout}
    assert not {c.answer for c in train} & {c.answer for c in heldout}
    assert all(len(c.answer) <= tiny_corpus.MAX_FUNCTION_CHARS for c in corpus)


def test_corpus_matches_the_build_given_the_builds_stdlib(corpus: list, build_info: dict) -> None:
    """The corpus is a function of the standard-library files it is read from: where those
    files are byte for byte the ones the build read (``stdlib_fingerprint``), the corpus must be
    the build's, conversation for conversation (``corpus_fingerprint``).

    Keyed on content, not on the version string: distributions patch their stdlib, so two
    "3.11.7"s can differ, and two versions can agree. Where the files differ the build's corpus
    cannot be reproduced here: that fails (with both fingerprints) rather than skips, since a
    skip would leave the embedded target's reproducibility unchecked on every such machine.
    """
    here = tiny_corpus.stdlib_fingerprint(tiny_corpus.stdlib_root())
    assert here == build_info["stdlib_fingerprint"], (
        f"this interpreter's stdlib ({platform.python_version()}, {here}) is not the one the "
        f"target was built from ({build_info['python_version']}, "
        f"{build_info['stdlib_fingerprint']}): its corpus is another corpus, and the build "
        "cannot be reproduced here"
    )
    heldout_sources = sorted({c.source for c in corpus if c.split == "heldout"})
    assert heldout_sources == build_info["heldout_sources"]
    assert sum(c.split == "train" for c in corpus) == build_info["corpus"]["train_conversations"]
    assert tiny_corpus.corpus_fingerprint(corpus) == build_info["corpus_fingerprint"]


def test_corpus_jsonl_is_openai_messages(corpus: list, tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    tiny_corpus.write_corpus_jsonl(corpus[:20], path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 20
    for row, conv in zip(rows, corpus[:20], strict=True):
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["messages"][1]["content"] == conv.answer
        assert row["source"] == conv.source and row["split"] == conv.split


# --- The target learned ------------------------------------------------------------------------


def test_heldout_answer_ce_is_far_below_unigram(
    target: tuple, heldout: list, build_info: dict
) -> None:
    model, tokenizer = target
    ce, n_tokens = tiny_target.heldout_answer_ce(model, tokenizer, heldout, 50)
    assert n_tokens > 2000
    assert ce < tiny_target.CHECK_MAX_CE
    assert ce < build_info["unigram_heldout_answer_ce"] - 1.5


def test_greedy_generation_for_a_heldout_prompt_is_python(target: tuple, heldout: list) -> None:
    model, tokenizer = target
    conv = tiny_corpus.check_subset(heldout, 1)[0]
    text = tokenizer.decode(tiny_target.greedy_generate(model, tokenizer, conv, max_new_tokens=48))
    assert any(marker in text for marker in ("def ", "return", ":\n")), text


# --- Tiny random-weight targets of other architectures -----------------------------------------


def _forward_hidden_states(model_dir: Path) -> tuple:
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    model.eval()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a function."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert model.config.vocab_size == len(tokenizer)
    assert out.logits.shape == (1, ids.shape[1], len(tokenizer))
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for h in out.hidden_states:
        assert h.shape == (1, ids.shape[1], model.config.hidden_size)
        assert torch.isfinite(h.float()).all()
    return model, out


def test_tiny_qwen3_runs_forward_with_hidden_states(tmp_path: Path) -> None:
    model_dir = random_targets.build_tiny_qwen3(tmp_path / "qwen3")
    model, _ = _forward_hidden_states(model_dir)
    assert model.config.model_type == "qwen3"
    assert model.dtype == torch.bfloat16


def test_tiny_deepseek_v3_is_mla_and_moe_like_kimi(tmp_path: Path) -> None:
    model_dir = random_targets.build_tiny_deepseek_v3(tmp_path / "dsv3")
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v3"
    assert saved["kv_lora_rank"] + saved["qk_rope_head_dim"] == 576
    assert saved["topk_method"] == "noaux_tc" and saved["scoring_func"] == "sigmoid"
    assert saved["first_k_dense_replace"] == 1 and saved["n_routed_experts"] == 8
    model, _ = _forward_hidden_states(model_dir)
    assert model.dtype == torch.bfloat16
    layers = model.model.layers
    assert not hasattr(layers[0].mlp, "experts")  # dense first layer
    assert hasattr(layers[1].mlp, "experts") and hasattr(layers[1].mlp, "shared_experts")


def test_tiny_targets_are_deterministic(tmp_path: Path) -> None:
    a = random_targets.build_tiny_qwen3(tmp_path / "a")
    b = random_targets.build_tiny_qwen3(tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


# --- vLLM serves the same model ----------------------------------------------------------------


# Held-out prompts compared, and tokens generated for each.
VLLM_CHECK_PROMPTS, VLLM_CHECK_TOKENS = 2, 16


@pytest.mark.vllm
def test_vllm_greedy_matches_transformers(
    tiny_vllm_server: str, target: tuple, heldout: list
) -> None:
    """vLLM serves the shipped target as transformers runs it: for held-out prompts rendered
    with its chat template, vLLM tokenizes the prompt text to the same ids and its greedy
    tokens are transformers' greedy tokens (the session's `vllm serve`, float32, eager)."""
    model, tokenizer = target
    for conv in tiny_corpus.check_subset(heldout, VLLM_CHECK_PROMPTS):
        text = tiny_target.prompt_text(tokenizer, conv)
        ids = tokenizer.encode(text, add_special_tokens=False)
        # /tokenize and /v1/completions tokenize a text prompt alike (add_special_tokens: true)
        tokenized = httpx.post(
            f"{tiny_vllm_server}/tokenize", json={"model": SERVED_NAME, "prompt": text}, timeout=60
        )
        assert tokenized.status_code == 200, tokenized.text
        assert tokenized.json()["tokens"] == ids, conv.prompt
        completion = httpx.post(
            f"{tiny_vllm_server}/v1/completions",
            json={
                "model": SERVED_NAME,
                "prompt": text,
                "max_tokens": VLLM_CHECK_TOKENS,
                "temperature": 0.0,
                "logprobs": 0,  # the chosen tokens, as "token_id:<id>"
                "return_tokens_as_token_ids": True,
            },
            timeout=300,
        )
        assert completion.status_code == 200, completion.text
        body = completion.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        served = [
            int(t.removeprefix("token_id:")) for t in body["choices"][0]["logprobs"]["tokens"]
        ]
        expected = tiny_target.greedy_generate(model, tokenizer, conv, VLLM_CHECK_TOKENS)
        assert served == expected, (
            conv.prompt,
            tokenizer.decode(served),
            tokenizer.decode(expected),
        )
