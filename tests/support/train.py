"""eagle3-train's test inputs: synthetic inputs (the hidden states from support.synthetic_states,
vocab maps, target configs and models), config files, CLI runs, small drafts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from eagle3_schemas.contract.header import make_header, write_safetensors
from eagle3_schemas.io.jsonl import complete_lines
from eagle3_train.model.arch import DraftArch
from eagle3_train.model.draft import Eagle3Draft

from support.synthetic_states import fake_fingerprint, write_dataset

REPO = Path(__file__).resolve().parents[2]


def vocab_arrays(v_target: int, v_draft: int, seed: int = 0):
    """(token counts, d2t, t2d): the draft vocabulary = the v_draft most counted ids."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 1000, v_target).astype(np.int64)
    chosen = np.sort(np.argsort(-counts, kind="stable")[:v_draft])
    t2d = np.zeros(v_target, dtype=bool)
    t2d[chosen] = True
    return counts, (chosen - np.arange(v_draft)).astype(np.int64), t2d


def write_vocab_map(
    path: Path, v_target: int, v_draft: int, seed: int = 0, label: str = "synthetic"
) -> Path:
    counts, _, _ = vocab_arrays(v_target, v_draft, seed)
    lineage = {
        "tokenized_fingerprint": fake_fingerprint(f"{label}/tokenized"),
        "tokenizer_fingerprint": fake_fingerprint(f"{label}/tokenizer"),
    }
    return write_vocab_map_from_counts(path, counts, v_draft, lineage)


def write_vocab_map_from_counts(
    path: Path, counts: np.ndarray, v_draft: int, lineage: dict[str, object]
) -> Path:
    """The vocab_map artifact for loss-token ``counts``: the v_draft most counted ids
    (ties by lower id), ascending; d2t as offsets."""
    counts = np.asarray(counts, dtype=np.int64)
    chosen = np.sort(np.argsort(-counts, kind="stable")[:v_draft])
    d2t = (chosen - np.arange(v_draft)).astype(np.int64)
    t2d = np.zeros(counts.shape[0], dtype=bool)
    t2d[chosen] = True
    coverage = float(counts[chosen].sum() / max(counts.sum(), 1))
    header = make_header(
        "vocab_map",
        lineage,
        draft_vocab_size=v_draft,
        target_vocab_size=int(counts.shape[0]),
        num_loss_tokens=int(counts.sum()),
        coverage=coverage,
    )
    write_safetensors(path, {"token_counts": counts, "d2t": d2t, "t2d": t2d}, header)
    return path


def write_target_config(
    directory: Path,
    hidden: int = 16,
    num_layers: int = 4,
    v_target: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 32,
    rms_norm_eps: float = 1e-6,
) -> Path:
    """A target model directory holding only config.json (enough for the draft's defaults)."""
    LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        vocab_size=v_target,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        intermediate_size=intermediate,
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(directory)
    return directory


def write_target_model(directory: Path, seed: int = 0, **sizes: int) -> Path:
    """A random-weight Llama target (config + model.safetensors) of ``write_target_config``'s
    sizes, for loaders that read the verifier's weights (speculators' from_pretrained)."""
    write_target_config(directory, **sizes)
    torch.manual_seed(seed)
    LlamaForCausalLM(AutoConfig.from_pretrained(directory)).save_pretrained(directory)
    return directory


@dataclass
class Inputs:
    root: Path
    hidden_states: Path
    vocab_map: Path
    target: Path


def make_inputs(
    root: Path,
    label: str = "synthetic",
    vocab_label: str | None = None,
    aux_layer_ids: tuple[int, ...] = (1, 2, 3),
    hidden: int = 16,
    target_hidden: int | None = None,
    v_draft: int = 24,
    **dataset_kwargs,
) -> Inputs:
    root.mkdir(parents=True, exist_ok=True)
    v_target = dataset_kwargs.pop("v_target", 64)
    hs = write_dataset(
        root / "hidden_states",
        hidden=hidden,
        aux_layer_ids=aux_layer_ids,
        v_target=v_target,
        label=label,
        **dataset_kwargs,
    )
    vm = write_vocab_map(
        root / "vocab_map.safetensors", v_target, v_draft, label=vocab_label or label
    )
    target = write_target_config(
        root / "target",
        hidden=target_hidden or hidden,
        v_target=v_target,
        num_layers=dataset_kwargs.get("num_layers", 4),
    )
    return Inputs(root, hs, vm, target)


def write_config(inputs: Inputs, output_dir: Path, **sections) -> Path:
    """A train config for ``inputs``; ``sections`` update the defaults section by section."""
    cfg = {
        "output_dir": str(output_dir),
        "target": {"path": str(inputs.target)},
        "draft": {"aux_layer_ids": [1, 2, 3], "attention_chunk": 64},
        "data": {
            "hidden_states": str(inputs.hidden_states),
            "vocab_map": str(inputs.vocab_map),
            "validation_fraction": 0.1,
            "max_tokens_per_batch": 128,
            "num_workers": 0,
        },
        "train": {
            "max_steps": 12,
            "lr": 3e-3,
            "warmup_steps": 2,
            "log_every": 1,
            "save_every": 4,
            "trackers": [],
            "torch_threads": 1,
            "progress_bar": False,
        },
        "export": {"dtype": "float32"},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg[section].update(values)
        else:
            cfg[section] = values
    path = output_dir.parent / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def validation_losses(config_path: Path) -> tuple[float, float]:
    """(val/loss of the model build_model makes for this config, of a fresh random start)."""
    from accelerate.state import AcceleratorState

    from eagle3_train.components.accelerator import make_accelerator
    from eagle3_train.components.build import build_model
    from eagle3_train.config.run_config import load_config
    from eagle3_train.data.inputs import load_inputs, resolve_arch
    from eagle3_train.run.setup import make_order
    from eagle3_train.run.validation import evaluate

    out = []
    for init in (True, False):
        config = load_config(config_path)
        if not init:
            config.draft.init_from = None
        inputs = load_inputs(config)
        model = build_model(inputs, resolve_arch(inputs), seed=config.train.seed)
        accelerator = make_accelerator(config, with_trackers=False)
        val_idx = make_order(inputs, config, 0, 1).validation_idx
        out.append(evaluate(accelerator, model, inputs, val_idx, config)["val/loss"])
        AcceleratorState._reset_state(reset_partial_state=True)
    return out[0], out[1]


def train_in_process(argv: list[str] | None) -> int:
    """eagle3-train's CLI in this process, its exit code; its global state (torch's thread count,
    Accelerate's state) undone after."""
    from accelerate.state import AcceleratorState

    from eagle3_train.cli import main

    threads = torch.get_num_threads()
    try:
        return main(argv)
    finally:
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(reset_partial_state=True)


def env_for_subprocess() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/eagle3/torch_extensions"))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(args: list[str], timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "eagle3_train", *args],
        cwd=cwd,
        env=env_for_subprocess(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The events of a metrics file, complete lines only (one still being written, or torn
    by a kill or a full disk, is left out)."""
    return [json.loads(line) for line in complete_lines(path)]


# Kimi-K2.5's / DeepSeek-V3's RoPE block as their config.json writes it (legacy "type" key).
YARN = {
    "type": "yarn",
    "factor": 32.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def small_arch(**overrides) -> DraftArch:
    """A 16-wide Llama-style draft the unit tests build in milliseconds, with ``overrides``."""
    base: dict = dict(
        hidden_size=16,
        num_aux=3,
        target_vocab_size=40,
        draft_vocab_size=20,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=32,
        rms_norm_eps=1e-6,
        target_rms_norm_eps=1e-5,
        max_position_embeddings=256,
        rope_theta=10000.0,
    )
    return DraftArch(**(base | overrides))


def small_draft(seed: int = 0, **overrides) -> Eagle3Draft:
    """A small_arch draft (with ``overrides``) with a random target head, seeded."""
    arch = small_arch(**overrides)
    torch.manual_seed(seed)
    model = Eagle3Draft(arch)
    g = torch.Generator().manual_seed(seed + 1)
    model.load_target_head(
        torch.randn(arch.target_vocab_size, arch.hidden_size, generator=g),
        1 + 0.1 * torch.randn(arch.hidden_size, generator=g),
        torch.randn(arch.draft_vocab_size, arch.hidden_size, generator=g),
    )
    return model


def yarn_arch(architecture: str = "llama") -> DraftArch:
    """A draft of a YaRN target, as resolve_arch copies the target's rope_scaling into it."""
    mla = {
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
    }
    return DraftArch(
        hidden_size=64,
        num_aux=3,
        target_vocab_size=128,
        draft_vocab_size=32,
        num_attention_heads=4,
        num_key_value_heads=2 if architecture == "llama" else 4,
        head_dim=16 if architecture == "llama" else 24,
        intermediate_size=128,
        rms_norm_eps=1e-6,
        target_rms_norm_eps=1e-6,
        max_position_embeddings=131072,
        rope_theta=50000.0,
        rope_scaling=dict(YARN),
        architecture=architecture,
        **(mla if architecture == "mla" else {}),
    )
