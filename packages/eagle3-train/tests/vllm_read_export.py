"""Run by test_vllm_readers.py in vLLM's environment: vLLM's own readers on what the export
wrote. argv: a JSON job {"serve": the card's `vllm serve` line, "draft": a draft directory,
"positions": [ints]}; prints one JSON line of what vLLM made of them."""

from __future__ import annotations

import json
import shlex
import sys


def parse_serve(line: str) -> dict:
    """The line through `vllm serve`'s own parser and validation, then into engine arguments."""
    import argparse

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    words = shlex.split(line)
    assert words[:2] == ["vllm", "serve"], words
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers)
    args = parser.parse_args(words[1:])
    serve.validate(args)
    args.model = args.model_tag or args.model
    # Under HF_HUB_OFFLINE (CI sets it) vLLM resolves a hub id to a local snapshot while it
    # builds the engine arguments; no snapshot exists here and none is wanted: the id is read
    # as the card names it. Online mode defers that lookup to loading, which this never does.
    import huggingface_hub.constants

    offline = huggingface_hub.constants.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = False
    try:
        engine = AsyncEngineArgs.from_cli_args(args)
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE = offline
    assert isinstance(args, argparse.Namespace)
    return {
        "model": engine.model,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "speculative_config": engine.speculative_config,
    }


def read_draft(draft: str, positions: list[int]) -> dict:
    """The draft's config as vLLM reads it (speculators parser, RoPE patching), and the rotary
    table vLLM's Llama layer would build from it."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config, patch_legacy_rope_type

    with open(f"{draft}/config.json") as f:
        raw = json.load(f)
    block = dict(raw["transformer_layer_config"]["rope_parameters"])
    patch_legacy_rope_type(block)  # raises on a rope_type / type conflict
    cfg = get_config(draft, trust_remote_code=False)
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(
            cfg.head_dim,
            max_position=cfg.max_position_embeddings,
            rope_parameters=cfg.rope_parameters,
            is_neox_style=True,
            dtype=torch.float32,
        )
    cache = rope.cos_sin_cache[positions].tolist()
    return {
        "config_class": type(cfg).__name__,
        "architectures": cfg.architectures,
        "rope_parameters": cfg.rope_parameters,
        "rotary_class": type(rope).__name__,
        "cos_sin": cache,
    }


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    out = {"serve": parse_serve(job["serve"]), "draft": read_draft(job["draft"], job["positions"])}
    print(json.dumps(out))
