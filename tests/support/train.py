"""eagle3-train's test inputs: synthetic inputs, config files, CLI runs, small drafts."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from eagle3_train.arch import DraftArch
from eagle3_train.synthetic import write_dataset, write_target_config, write_vocab_map

REPO = Path(__file__).resolve().parents[2]


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
    vm = write_vocab_map(root / "vocab_map.safetensors", v_target, 24, label=vocab_label or label)
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
