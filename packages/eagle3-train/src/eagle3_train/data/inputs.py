"""The run's inputs, read once: dataset, vocab map, target config; the resolved draft shape.

Reading is cheap (headers, manifest, config.json); the cross-checks that can stop a run live
in preflight/ and use what is loaded here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_schemas.contract.header import ArtifactError, read_header
from eagle3_schemas.contract.lineage import fingerprint_artifact, fingerprint_vocab_map
from eagle3_schemas.contract.stream import fingerprint_stream
from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_schemas.layouts.target_config import text_config
from eagle3_train.config.run_config import Config
from eagle3_train.data.dataset import HiddenStateDataset
from eagle3_train.data.stream import StreamWindows, wait_for_stream
from eagle3_train.export.init_from import fingerprint_init_draft, read_init_draft
from eagle3_train.model.arch import NORM_OPTIONS, DraftArch


class InputError(ValueError):
    """An input cannot be read as what the config says it is."""


@dataclass
class VocabMap:
    path: Path
    d2t: np.ndarray
    t2d: np.ndarray
    lineage: dict[str, Any]
    fields: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return fingerprint_vocab_map(self.d2t, self.t2d)

    @property
    def draft_vocab_size(self) -> int:
        return int(self.d2t.shape[0])

    @property
    def target_ids(self) -> np.ndarray:
        return np.arange(self.draft_vocab_size) + self.d2t


@dataclass
class RunInputs:
    config: Config
    dataset: HiddenStateDataset
    vocab: VocabMap
    target_config: dict[str, Any] | None
    target_config_path: Path | None
    # data.stream: the stream the dataset grows from (window 0 is opened by preflight's dry
    # run or the data order, after the lineage checks: a wrong stream is refused at once)
    stream: StreamWindows | None = None

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.dataset.aux_layer_ids


def load_vocab_map(path: str | Path) -> VocabMap:
    path = Path(path)
    try:
        header = read_header(path)
        st = read_safetensors(path)
        d2t, t2d = np.array(st.array("d2t")), np.array(st.array("t2d"))
    except (ArtifactError, OSError, KeyError, ValueError) as e:
        raise InputError(f"{path}: cannot read the vocab map ({e})") from e
    if header.artifact != "vocab_map":
        raise InputError(f"{path}: header says artifact {header.artifact!r}, expected 'vocab_map'")
    return VocabMap(path, d2t, t2d, header.lineage, header.fields)


def load_target_config(path: str | Path | None) -> tuple[dict[str, Any] | None, Path | None]:
    if path is None:
        return None, None
    cfg_path = Path(path) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"target.path: cannot read {cfg_path} ({e})") from e
    except json.JSONDecodeError as e:
        raise InputError(f"{cfg_path}: not valid JSON ({e})") from e
    return text_config(cfg), cfg_path


def load_inputs(config: Config) -> RunInputs:
    vocab = load_vocab_map(config.data.vocab_map)
    target_config, target_config_path = load_target_config(config.target.path)
    d = config.data
    if d.stream:
        info = wait_for_stream(Path(d.hidden_states), d.stream_timeout_s)
        stream = StreamWindows(
            info,
            d.window_shards,
            deep_check=config.train.validate_inputs,
            reclaim=d.reclaim,
            retain_first=d.validation_fraction > 0,
            timeout_s=d.stream_timeout_s,
        )
        return RunInputs(config, stream.dataset, vocab, target_config, target_config_path, stream)
    root = Path(d.hidden_states)
    if not (root / "dataset.json").is_file():
        raise InputError(
            f"data.hidden_states: {root} has no dataset.json (not a hidden-state dataset)"
        )
    try:
        dataset = HiddenStateDataset(root)
    except (OSError, KeyError, ValueError) as e:
        raise InputError(
            f"{root}: cannot read the hidden-state dataset ({type(e).__name__}: {e})"
        ) from e
    return RunInputs(config, dataset, vocab, target_config, target_config_path)


def _rope(target: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    params = target.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", target.get("rope_theta"))
        rest = {k: v for k, v in params.items() if k != "rope_theta"}
        scaling = rest if rest.get("rope_type", "default") != "default" else None
        return theta, scaling
    return target.get("rope_theta"), target.get("rope_scaling")


def target_rms_norm_eps(inputs: RunInputs) -> tuple[float | None, str]:
    """The target's final-norm eps and where it came from (config > dataset > target config)."""
    if inputs.config.target.rms_norm_eps is not None:
        return inputs.config.target.rms_norm_eps, "config target.rms_norm_eps"
    from_header = inputs.dataset.header["target"].get("rms_norm_eps")
    if from_header is not None:
        return float(from_header), f"{inputs.dataset.header_file} target.rms_norm_eps"
    if inputs.target_config is not None and "rms_norm_eps" in inputs.target_config:
        return float(inputs.target_config["rms_norm_eps"]), str(inputs.target_config_path)
    return None, "nowhere"


# The MLA draft's attention shape (copied from an MLA target unless the config sets it).
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def resolve_arch(inputs: RunInputs) -> DraftArch:
    """The draft's shape: config values, else the target's config.json (target.path), else
    the same keys in dataset.json ``target`` (where the extract stage recorded them), else an
    error naming the missing draft.* keys."""
    d = inputs.config.draft
    t = {**inputs.dataset.header["target"], **(inputs.target_config or {})}
    H = inputs.dataset.hidden_size
    heads = d.num_attention_heads or t.get("num_attention_heads")
    theta, scaling = _rope(t)
    values: dict[str, Any] = {
        "num_attention_heads": heads,
        "num_key_value_heads": d.num_key_value_heads or t.get("num_key_value_heads") or heads,
        "head_dim": d.head_dim or t.get("head_dim") or (H // heads if heads else None),
        "intermediate_size": d.intermediate_size or t.get("intermediate_size"),
        "rms_norm_eps": d.rms_norm_eps or t.get("rms_norm_eps"),
        "max_position_embeddings": d.max_position_embeddings or t.get("max_position_embeddings"),
        "rope_theta": d.rope_theta or theta or 10000.0,
    }
    if d.architecture == "mla":
        for key in MLA_KEYS:
            values[key] = getattr(d, key) or t.get(key)
        values["num_key_value_heads"] = heads  # MLA expands its latent to every head
        if values["qk_nope_head_dim"] and values["qk_rope_head_dim"]:
            values["head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    missing = [k for k, v in values.items() if v is None]
    if missing:
        raise InputError(
            f"draft.{', draft.'.join(missing)}: no value — set them in the config or point "
            "target.path at the target model directory (its config.json supplies them); "
            f"{inputs.dataset.header_file} target does not record them"
        )
    eps, _ = target_rms_norm_eps(inputs)
    if eps is None:
        raise InputError(
            "target RMSNorm eps unknown: dataset.json has no target.rms_norm_eps and no "
            "target.path config.json gives one; set target.rms_norm_eps"
        )
    floats = ("rms_norm_eps", "rope_theta")
    from_config = ("num_layers", "architecture", "attention", "attention_chunk", "loss_chunk")
    return DraftArch(
        hidden_size=H,
        num_aux=inputs.dataset.num_aux,
        target_vocab_size=inputs.dataset.vocab_size,
        draft_vocab_size=inputs.vocab.draft_vocab_size,
        **{k: float(v) if k in floats else int(v) for k, v in values.items()},
        target_rms_norm_eps=float(eps),
        rope_scaling=d.rope_scaling if d.rope_scaling is not None else scaling,
        **{k: getattr(d, k) for k in (*from_config, *NORM_OPTIONS)},
    )


def load_target_head(dataset_root: Path, target_ids: np.ndarray) -> dict[str, torch.Tensor]:
    """Frozen target tensors as float32: embeddings, final norm, lm_head rows of the draft vocab."""
    from safetensors import safe_open

    path = dataset_root / "target_head.safetensors"
    with safe_open(str(path), framework="pt") as f:
        embed = f.get_tensor("embed_tokens.weight").float()
        norm = f.get_tensor("norm.weight").float()
        lm_rows = f.get_tensor("lm_head.weight")[torch.from_numpy(target_ids)].float()
    return {"embed_tokens": embed, "norm": norm, "lm_head_rows": lm_rows}


def checkpoint_lineage(inputs: RunInputs) -> dict[str, Any]:
    """The draft checkpoint's lineage (schemas/draft_checkpoint/v1.json)."""
    ds = inputs.dataset.header.get("lineage", {})
    if inputs.stream is not None:
        hidden_states = fingerprint_stream(inputs.stream.info)
    else:
        hidden_states = fingerprint_artifact(inputs.dataset.root)
    return {
        "target_fingerprint": ds.get("target_fingerprint"),
        "tokenizer_fingerprint": ds.get("tokenizer_fingerprint"),
        "hidden_states_fingerprint": hidden_states,
        "vocab_map_fingerprint": inputs.vocab.fingerprint,
        "tokenized_fingerprint": ds.get("tokenized_fingerprint"),
        "aux_layer_ids": inputs.aux_layer_ids,
        **init_from_lineage(inputs),
    }


def init_from_lineage(inputs: RunInputs) -> dict[str, str]:
    """draft.init_from's fingerprint (config and weight bytes), when the run started from one."""
    if not inputs.config.draft.init_from:
        return {}
    path = inputs.config.draft.init_from
    return {
        "init_from_fingerprint": fingerprint_init_draft(path),
        # the layout it was read in (eagle3_schemas.layouts.draft_layout): speculators, vllm-mla, sglang
        "init_from_layout": read_init_draft(path).layout,
    }
