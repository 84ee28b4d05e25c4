"""A Kimi-K2.5-shaped stand-in, built at test time: the flagship's traps at a size CPUs run.

    PYTHONPATH=tests uv run python -m support.kimi_standin OUT_DIR   (about 20 s; random weights, seeded)

What it keeps of the real model (recipes/kimi-k2.5/target_config.json, the hub's config.json):
- the multimodal wrapper: ``architectures: ["KimiK25ForConditionalGeneration"]``, ``model_type:
  "kimi_k25"``, the DeepseekV3 text model's config nested under ``text_config`` (its own
  ``model_type: "kimi_k2"``), a ``vision_config``, and the weights under the hub's prefix
  (``language_model.model.*``, ``language_model.lm_head.weight``);
- the text backbone's kind: MLA attention with the real ``kv_lora_rank`` 512 and
  ``qk_rope_head_dim`` 64 (also the only MLA head size vLLM's CPU backend runs), the real YaRN
  RoPE (factor 64, beta_fast 32), first layer dense then MoE (routed experts top-k plus one
  shared expert, ``noaux_tc`` sigmoid routing), untied LM head, bf16;
- the tokenizer: custom Python code (``tokenization_kimi.TikTokenTokenizer`` through
  ``auto_map``, needs ``--trust-remote-code``) over a tiktoken BPE file of exactly 163,584 ranks
  plus 256 reserved special tokens at the real ids (163,840 in all), Kimi's pre-tokenizing
  pattern, and a chat template in Kimi's format with thinking blocks;
- the full 163,840-token vocabulary, so embeddings, LM head, ``t2d`` and the 32k draft vocabulary
  have their real sizes.

What it changes: sizes (hidden 128, 7 layers = 61 // 8, so aux ids [2, 3, 4] follow the same
[2, N//2, N-3] rule; 8 routed experts top-2), no INT4 (the routed experts are bf16, so the
transformers backend can run it — the INT4 refusal is tested on the real config), no vision
weights (text only; vLLM runs it ``language_model_only``, and still reads the image
processor's ``preprocessor_config.json``, shipped as the hub has it), no model code (transformers and vLLM
have native classes for both configs, so ``auto_map`` is dropped from config.json). The BPE ranks
are learned from this Python's standard library; past what that corpus yields, ranks are filled
with Han characters and two-character Han words (Kimi's vocabulary is about half Chinese), each
reachable by merges.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE = REPO_ROOT / "recipes" / "kimi-k2.5"
FILES = Path(__file__).resolve().parent / "kimi_standin_files"
BPE_RANKS = 163_584
RESERVED_SPECIAL_TOKENS = 256
# Kimi-K2.5's named special tokens and their ids (the others are <|reserved_token_ID|>).
SPECIAL_TOKENS = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
ADDITIONAL_SPECIAL_TOKENS = [
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|im_middle|>",
]
# Stand-in sizes of the text model; MLA's 512 + 64 and the vocabulary stay real.
STANDIN_TEXT = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 96,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    # Random weights at the real 0.02 make a 7-layer model repeat one token whatever the
    # prompt; 0.1 gives varied greedy continuations to compare engines on.
    "initializer_range": 0.1,
}
# vLLM loads the image processor's settings even for text-only serving (the hub's file).
PREPROCESSOR_CONFIG = {
    "media_proc_cfg": {
        "in_patch_limit": 16384,
        "patch_size": 14,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "merge_kernel_size": 2,
        "fixed_output_tokens": None,
        "patch_limit_on_one_side": 512,
        "in_patch_limit_each_frame": 4096,
        "in_patch_limit_video": None,
        "sample_fps": 2.0,
        "max_num_frames_each_video": None,
        "temporal_merge_kernel_size": 4,
        "timestamp_mode": "hh:mm:ss.fff",
        "config_type": "media_proc.processors.moonvit.MoonViTMediaProcessorConfig",
    }
}
DEPTH_DIVISOR = 8  # 61 layers -> 7: the smallest depth where [2, N//2, N-3] are distinct
STANDIN_VISION = {
    "mm_hidden_size": 32,
    "vt_hidden_size": 32,
    "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
}


def target_facts() -> dict[str, Any]:
    return json.loads((RECIPE / "target_config.json").read_text(encoding="utf-8"))


def standin_config(facts: dict[str, Any]) -> dict[str, Any]:
    """The real config.json with sizes scaled down; same keys and nesting, INT4 and code dropped."""
    config = {k: v for k, v in facts.items() if k != "auto_map"}
    text = {
        k: v
        for k, v in facts["text_config"].items()
        if k not in ("auto_map", "quantization_config")
    }
    text.update(
        STANDIN_TEXT, num_hidden_layers=facts["text_config"]["num_hidden_layers"] // DEPTH_DIVISOR
    )
    config["text_config"] = text
    config["vision_config"] = dict(
        facts["vision_config"], **STANDIN_VISION, text_hidden_size=text["hidden_size"]
    )
    return config


# ---- tokenizer -----------------------------------------------------------------------------


def corpus_texts() -> list[str]:
    """This Python's standard library sources (deterministic for a given stdlib)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def _han_fill(taken: set[bytes], needed: int) -> list[bytes]:
    """Han tokens reachable by merges: each character's 2-byte UTF-8 prefix, the characters,
    then two-character words, in code-point order, until ``needed`` new tokens exist."""
    chars = [chr(c) for c in range(0x4E00, 0xA000)]
    fill: list[bytes] = []

    def add(token: bytes) -> bool:
        if token not in taken:
            taken.add(token)
            fill.append(token)
        return len(fill) >= needed

    for c in chars:
        if add(c.encode()[:2]):
            return fill
    for c in chars:
        if add(c.encode()):
            return fill
    for first in chars:
        for second in chars:
            if add((first + second).encode()):
                return fill
    raise AssertionError("unreachable: 20,992^2 two-character words exceed any vocabulary")


def bpe_ranks(texts: list[str], size: int = BPE_RANKS) -> list[bytes]:
    """``size`` byte strings in rank order: the 256 bytes, merges learned from ``texts``, Han fill."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    byte_of = {ch: b for b, ch in bytes_to_unicode().items()}
    ranks = [bytes([b]) for b in range(256)]
    taken = set(ranks)
    for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        data = bytes(byte_of[ch] for ch in token)
        if data not in taken and len(ranks) < size:
            taken.add(data)
            ranks.append(data)
    return ranks + _han_fill(taken, size - len(ranks))


def save_tokenizer(out_dir: Path, ranks: list[bytes]) -> None:
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(ranks))
    (out_dir / "tiktoken.model").write_text("".join(lines), encoding="ascii")
    config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "unk_token": "[UNK]",
        "pad_token": "[PAD]",
        "additional_special_tokens": ADDITIONAL_SPECIAL_TOKENS,
        "added_tokens_decoder": {
            str(i): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, token in SPECIAL_TOKENS.items()
        },
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000_000_000_000_019_884_624_838_656,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    for name in ("tokenization_kimi.py", "chat_template.jinja"):
        shutil.copyfile(FILES / name, out_dir / name)


# ---- weights -------------------------------------------------------------------------------


def save_weights(out_dir: Path, config: dict[str, Any], seed: int) -> None:
    """Random DeepseekV3 text weights (seeded), bf16, in the wrapper's checkpoint layout."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    save_wrapped(DeepseekV3ForCausalLM(DeepseekV3Config(**text_model_config(config))), out_dir)


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """The wrapper's ``text_config`` as transformers' DeepseekV3Config takes it."""
    # A deep copy: transformers' config classes rewrite the rope dict they are given in place.
    text = copy.deepcopy(dict(config["text_config"], model_type="deepseek_v3"))
    text.pop("architectures", None)
    return text


def save_wrapped(model: Any, out_dir: Path) -> None:
    """A DeepseekV3ForCausalLM's weights in bf16 under the hub checkpoint's names.

    ``save_pretrained`` writes the checkpoint layout (one tensor per routed expert, as vLLM and
    the hub have it; transformers fuses experts only in memory); the names then get the
    wrapper's ``language_model.`` prefix."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
        tensors = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(path))
    tensors = {f"language_model.{name}": t.contiguous() for name, t in tensors.items()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


def build_standin(out_dir: Path, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = standin_config(target_facts())
    save_tokenizer(out_dir, bpe_ranks(corpus_texts()))
    save_weights(out_dir, config, seed)
    save_wrapper_files(out_dir, config)
    return out_dir


def save_wrapper_files(out_dir: Path, config: dict[str, Any]) -> None:
    """config.json, the image processor's file vLLM reads, generation_config.json."""
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "preprocessor_config.json").write_text(
        json.dumps(PREPROCESSOR_CONFIG, indent=2) + "\n"
    )
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m support.kimi_standin OUT_DIR")
    print(build_standin(Path(sys.argv[1])))
