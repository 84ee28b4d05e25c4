"""The target model under transformers: loading, aux hidden states by vLLM layer ids, stop ids.

Layer-id convention (vLLM's): id k is the residual stream after k decoder layers — 0 is the
embedding output, N the last decoder layer's output *before* the final norm. Hooks capture
exactly those tensors (decoder layer k-1's output for k >= 1); Hugging Face's
``output_hidden_states[N]`` is after the final norm and is deliberately not used.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(ValueError):
    """The target cannot be used as asked."""


@dataclass
class Target:
    path: Path
    model: nn.Module
    tokenizer: Any
    config: dict[str, Any]

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    @property
    def embed_tokens(self) -> Tensor:
        return self.model.get_input_embeddings().weight.detach()


def load_target(
    path: str | Path, dtype: str = "float32", trust_remote_code: bool = False
) -> Target:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoTokenizer,
    )
    from transformers.utils import logging as hf_logging

    path = Path(path)
    if not (path / "config.json").is_file():
        raise TargetError(f"{path}: no config.json; expected a Hugging Face model directory")
    if dtype not in DTYPES:
        raise TargetError(f"dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(
        path, local_files_only=True, trust_remote_code=trust_remote_code
    )
    kwargs: dict[str, Any] = {}
    loader: Any = AutoModelForCausalLM
    wrapper = AutoConfig.from_pretrained(
        path, local_files_only=True, trust_remote_code=trust_remote_code
    )
    if hasattr(wrapper, "text_config"):
        # A multimodal wrapper (Kimi-K2.5) generates text through its own class; prompts are
        # text, so its vision tower is built without layers.
        if hasattr(getattr(wrapper, "vision_config", None), "num_hidden_layers"):
            wrapper.vision_config.num_hidden_layers = 0
        loader, kwargs = AutoModelForImageTextToText, {"config": wrapper}
    # transformers prints a load report: a wrapper's vision weights are expected to be absent.
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = loader.from_pretrained(
            path,
            local_files_only=True,
            dtype=DTYPES[dtype],
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
            output_loading_info=True,
            **kwargs,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    text_prefixes = ("model.language_model.", "lm_head.") if "config" in kwargs else ("",)
    missing = sorted(k for k in info.get("missing_keys") or [] if k.startswith(text_prefixes))
    if missing:
        raise TargetError(
            f"{path}: {len(missing)} weight(s) of the language model are not in the checkpoint "
            f"(e.g. {missing[:3]}); they would be random"
        )
    model.eval()
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return Target(path, model, tokenizer, config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TargetError(
            f"{type(model).__name__}: cannot find the decoder layers (model.get_decoder().layers)"
        )
    return layers


@contextlib.contextmanager
def capture_aux(model: nn.Module, layer_ids: tuple[int, ...]) -> Iterator[list[Tensor]]:
    """Yield a list that, after each forward, holds [batch, T, n_aux, H] (ids ascending).

    The list is cleared and refilled by every forward inside the block.
    """
    layers = decoder_layers(model)
    if any(i > len(layers) for i in layer_ids):
        raise TargetError(
            f"aux layer ids {list(layer_ids)} exceed the target's {len(layers)} decoder layers"
        )
    captured: dict[int, Tensor] = {}
    out: list[Tensor] = []

    def keep(layer_id: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            captured[layer_id] = output[0] if isinstance(output, tuple) else output
            if len(captured) == len(layer_ids):
                out.clear()
                out.append(torch.stack([captured[i] for i in layer_ids], dim=2))
                captured.clear()

        return hook

    handles = []
    for layer_id in layer_ids:
        module = model.get_input_embeddings() if layer_id == 0 else layers[layer_id - 1]
        handles.append(module.register_forward_hook(keep(layer_id)))
    try:
        yield out
    finally:
        for handle in handles:
            handle.remove()


def crop_cache(cache: Any, length: int) -> None:
    """Drop cached positions beyond ``length`` (a negative crop removes that many tokens)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
