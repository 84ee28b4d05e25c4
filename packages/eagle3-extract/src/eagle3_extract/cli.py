"""``eagle3-extract``: capture target hidden states into a sharded dataset.

    eagle3-extract run --model DIR --tokenized FILE --out DIR [--backend hf|vllm] ...
        [--max-samples N [--sample-seed S]] [--stream [--disk-budget 200GB] [--epochs E]]
    eagle3-extract preflight --model DIR --tokenized FILE --out DIR [...]   (checks only)
    eagle3-extract plan --model DIR --samples N --(max-)tokens-per-sample L [--tensor-parallel-size 8
        --gpu-memory-gib 141 --out DIR]                          (sizes before any data exists)
    eagle3-extract merge --out DIR IN_DIR...
    eagle3-extract verify DATASET --model DIR [--tokenized FILE] [--samples N]

Exit status: 0 success, 1 a check failed (preflight, verify, merge refusal), 2 bad usage (a bad
argument or path, refused before any work).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path
from typing import Any

from eagle3_extract.config import (
    BACKENDS,
    COMPUTE_DTYPES,
    DEFAULT_SHARD_MB,
    STORAGE_DTYPES,
    ConfigError,
    ExtractConfig,
)
from eagle3_schemas.contract.paths import PathArgumentError, check_output
from eagle3_schemas.io.diskspace import EXIT_DISK_FULL, DiskFull
from eagle3_schemas.layouts.remote_code import RemoteCodeRefused
from eagle3_schemas.runtime.options import config_from_args
from eagle3_schemas.runtime.signals import EXIT_PREEMPTED

log = logging.getLogger("eagle3_extract")


def _layer_ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _size(text: str) -> int:
    """Bytes from '200GB', '1.5TiB', '4096'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a size such as 200GB, 512MiB or 4096 (bytes)"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _vllm_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True, help="target model directory (HF format)")
    p.add_argument("--tokenized", type=Path, required=True, help="tokenized samples (Parquet)")
    p.add_argument("--out", type=Path, required=True, help="dataset directory to create")
    p.add_argument("--backend", choices=BACKENDS, default="hf")
    p.add_argument(
        "--aux-layer-ids",
        type=_layer_ids,
        help="comma-separated vLLM layer ids (default [2, N//2, N-3], spread evenly for N < 7)",
    )
    p.add_argument("--storage-dtype", choices=STORAGE_DTYPES, default="bfloat16")
    p.add_argument(
        "--dtype",
        dest="compute_dtype",
        choices=COMPUTE_DTYPES,
        default="auto",
        help="compute dtype (auto: float32 for hf, the model's own for vllm)",
    )
    p.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: --model)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python code the model or tokenizer ships (auto_map; Kimi's tokenizer); "
        "without it such a directory is refused before any work",
    )
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--shard-mb", type=float, default=DEFAULT_SHARD_MB, help="target shard size")
    p.add_argument("--batch-tokens", type=int, default=8192, help="hf: padded tokens per batch")
    p.add_argument("--device", default="cpu", help="hf: where the target runs (cpu, cuda, cuda:N)")
    p.add_argument(
        "--max-samples",
        type=int,
        help="only N tokenized samples: the first N, or a random N with --sample-seed",
    )
    p.add_argument(
        "--sample-seed",
        type=int,
        help="with --max-samples: draw the N samples at random with this seed (reproducible; "
        "the first N of a corpus sorted by source are a biased subset)",
    )
    p.add_argument("--no-validate", dest="validate_output", action="store_false")
    p.add_argument(
        "--stream",
        action="store_true",
        help="write a stream that eagle3-train (data.stream) trains on while extraction runs; "
        "not published: rerun without --stream afterwards to publish a dataset",
    )
    p.add_argument(
        "--disk-budget",
        type=_size,
        help="with --stream: pause while the shards on disk would exceed this (e.g. 200GB, "
        "512MiB); the trainer's --reclaim frees them",
    )
    p.add_argument(
        "--epochs",
        dest="stream_epochs",
        type=int,
        default=1,
        help="with --stream: extract everything once per training epoch, so a reclaiming "
        "trainer can train that many epochs (costs that many extractions)",
    )
    p.add_argument(
        "--preempt-signals",
        default="SIGTERM",
        help="comma-separated signals that stop the run after the shard in flight is sealed, "
        "exit 5, rerun resumes (default SIGTERM; e.g. SIGTERM,SIGUSR1 for Slurm --signal)",
    )
    v = p.add_argument_group("vLLM (passed through)")
    v.add_argument("--tensor-parallel-size", type=int, default=1)
    v.add_argument("--pipeline-parallel-size", type=int, default=1)
    v.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    v.add_argument("--max-model-len", type=int)
    v.add_argument("--max-num-batched-tokens", type=int)
    v.add_argument("--enforce-eager", action="store_true")
    v.add_argument("--shards-per-call", type=int, default=4, help="shards per LLM.generate call")
    v.add_argument(
        "--vllm-arg",
        type=_vllm_arg,
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="any other LLM(...) keyword argument",
    )


def _config(args: argparse.Namespace, preflight: bool = True) -> ExtractConfig:
    return config_from_args(
        ExtractConfig,
        args,
        preflight=preflight,
        vllm_kwargs=dict(args.vllm_arg),
        preempt_signals=tuple(s for s in args.preempt_signals.split(",") if s.strip()),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3-extract",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="extract (preflight first; resumes a killed run)")
    _add_run_args(run)
    run.add_argument("--no-preflight", action="store_true", help="skip the checks (not advised)")
    pre = sub.add_parser("preflight", help="only the checks run does first")
    _add_run_args(pre)
    plan = sub.add_parser(
        "plan", help="disk, GPU memory and parallelism for planned sizes, from config.json alone"
    )
    plan.add_argument("--model", type=Path, required=True, help="target directory (config.json)")
    plan.add_argument("--aux-layer-ids", type=_layer_ids, help="default [2, N//2, N-3]")
    plan.add_argument("--storage-dtype", choices=STORAGE_DTYPES, default="bfloat16")
    plan.add_argument("--samples", type=int, required=True, help="samples planned")
    per_sample = plan.add_mutually_exclusive_group(required=True)
    per_sample.add_argument("--tokens-per-sample", type=int, help="their expected mean length")
    per_sample.add_argument(
        "--max-tokens-per-sample",
        type=int,
        help="their length cap: the disk figure is then an upper bound (a warning, not an error)",
    )
    plan.add_argument("--tensor-parallel-size", type=int, default=1)
    plan.add_argument("--pipeline-parallel-size", type=int, default=1)
    plan.add_argument("--gpus", type=int, help="GPUs on the node")
    plan.add_argument("--gpu-memory-gib", type=float, help="memory of one GPU")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    plan.add_argument("--max-model-len", type=int, help="one sequence of it must fit the KV cache")
    plan.add_argument("--out", type=Path, help="where the dataset will go (disk check)")
    plan.add_argument("--json", type=Path, help="also write the figures here (replaced)")
    merge = sub.add_parser("merge", help="join the datasets of several ranks")
    merge.add_argument("--out", type=Path, required=True)
    merge.add_argument("inputs", type=Path, nargs="+")
    merge.add_argument("--allow-missing-ranks", action="store_true")
    verify = sub.add_parser("verify", help="recompute samples with the reference and compare")
    verify.add_argument("dataset", type=Path)
    verify.add_argument("--model", type=Path, required=True)
    verify.add_argument("--tokenized", type=Path, help="check token ids and lineage against it")
    verify.add_argument("--samples", type=int, default=8, help="samples to recompute")
    verify.add_argument("--tolerance", type=float, help="max relative error per layer")
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--json", type=Path, help="also write the report here (replaced)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return _dispatch(args)
    except (ConfigError, PathArgumentError, RemoteCodeRefused) as e:
        log.error("%s", e)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    from eagle3_extract.merge import MergeError
    from eagle3_extract.preflight import PreflightError

    if args.command == "run":
        from eagle3_extract.run import run
        from eagle3_extract.streaming import DiskBudgetError
        from eagle3_extract.workdir import ResumeError

        try:
            summary = run(_config(args, preflight=not args.no_preflight))
        except (PreflightError, ResumeError, DiskBudgetError) as e:
            log.error("%s", e)
            return 1
        except DiskFull as e:  # every sealed shard kept; rerun resumes once space is freed
            log.error("disk full: %s", e)
            return EXIT_DISK_FULL
        print(json.dumps(summary))
        return EXIT_PREEMPTED if summary["status"] == "preempted" else 0
    if args.command == "preflight":
        from eagle3_extract.run import preflight_only

        findings = preflight_only(_config(args))
        for finding in findings:
            print(finding)
        return 1 if any(f.level == "error" for f in findings) else 0
    if args.command == "plan":
        return _plan(args)
    if args.command == "merge":
        from eagle3_extract.merge import merge

        try:
            print(json.dumps(merge(args.inputs, args.out, args.allow_missing_ranks)))
        except MergeError as e:
            log.error("%s", e)
            return 1
        return 0
    if args.command == "verify":
        from eagle3_extract.verify import verify

        if args.json:  # before the recomputation, not after it
            # A check's report, not an artifact: rerunning verify refreshes it (atomically).
            expected = "a JSON report file"
            check_output(args.json, "--json", expected, suffix=".json", may_exist=True)
        report = verify(
            args.dataset,
            args.model,
            args.tokenized,
            num_samples=args.samples,
            tolerance=args.tolerance,
            seed=args.seed,
        )
        print(report.render())
        if args.json:
            from eagle3_schemas.io.atomic import write_json_atomic

            write_json_atomic(args.json, report.to_json())
        return 0 if report.ok else 1
    raise AssertionError(args.command)


def _plan(args: argparse.Namespace) -> int:
    from eagle3_extract.config import check_layer_ids, default_aux_layer_ids
    from eagle3_extract.preflight import check_cuda_driver
    from eagle3_extract.sizing import PlanInputs, make_plan
    from eagle3_extract.target import read_target
    from eagle3_schemas.contract.paths import check_input_dir

    check_input_dir(
        args.model, "--model", "a target model directory", must_contain=("config.json",)
    )
    per_sample = args.tokens_per_sample or args.max_tokens_per_sample
    if args.samples < 1 or per_sample < 1:
        raise ConfigError("--samples and the tokens per sample must be >= 1")
    if args.json:
        check_output(args.json, "--json", "a JSON report file", suffix=".json", may_exist=True)
    target = read_target(args.model)
    aux = list(args.aux_layer_ids or default_aux_layer_ids(target.num_hidden_layers))
    check_layer_ids(aux, target.num_hidden_layers)
    inputs = config_from_args(
        PlanInputs,
        args,
        aux_layer_ids=aux,
        num_tokens=args.samples * per_sample,
        num_samples=args.samples,
        tokens_are_bound=args.max_tokens_per_sample is not None,
    )
    plan = make_plan(inputs, target)
    # This host's NVIDIA driver against the CUDA release torch/vLLM need (none: not a GPU host).
    plan.findings += check_cuda_driver("torch (and vLLM, built on it)")
    for finding in plan.findings:
        print(finding)
    figures = {"aux_layer_ids": aux, **plan.figures, "ok": plan.ok}
    print(json.dumps(figures))
    if args.json:
        from eagle3_schemas.io.atomic import write_json_atomic

        write_json_atomic(args.json, figures)
    return 0 if plan.ok else 1


if __name__ == "__main__":
    sys.exit(main())
