"""``eagle3-eval``: acceptance length and speedup of an EAGLE-3 draft, as vLLM reports them.

    eagle3-eval offline   --draft DRAFT --hidden-states HELDOUT_DS --out REPORT
    eagle3-eval reference --draft DRAFT --target TARGET --prompts [NAME=]PROMPTS --out REPORT
    eagle3-eval vllm      --draft [NAME=]DRAFT ... --target TARGET --prompts [NAME=]PROMPTS ... --out OUT
    eagle3-eval report    REPORT [--figure]
    eagle3-eval compare   REPORT_A REPORT_B

--prompts is repeatable, one prompt set each: MT-Bench question.jsonl (per category; the second
turn is asked after the target's own greedy answer to the first), HumanEval .jsonl(.gz), GSM8K
.jsonl, or conversations (JSONL, ShareGPT, eagle3-data Parquet; held out by split/source).
Reports give acceptance, per-position rates and drafts per set, per category and per kind of
traffic (instant, thinking, agent: each prompt's, from its row) beside the overall figure. --draft is repeatable: each draft is served by an engine of its own, the
target alone runs once as every draft's baseline, each draft's report goes to OUT/<NAME>/ and
one table, draft x set/category, to OUT/table.md, table.json and table.png.

Acceptance length is 1 + accepted / drafts (vLLM's convention); per-position rates sum to it
minus one. Several --temperature values write OUT/temperature-<T>/ each. Every report is
validated against schemas/eval_report before it appears. ``reference`` and ``vllm`` also put
their acceptance table into the draft's model card (DRAFT/README.md, written by eagle3-train),
replacing an earlier table of the same setting; ``--no-card`` leaves the card alone.

This module imports only argparse at the top: ``python -m eagle3_eval vllm-engine`` runs in
vLLM's environment, where the rest of this project's dependencies may be missing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _online_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft",
        action="append",
        required=True,
        metavar="[NAME=]DRAFT",
        help="draft checkpoint directory; repeatable: several drafts, one table (NAME: its row "
        "and folder under --out; default the directory's name)",
    )
    p.add_argument("--target", type=Path, required=True, help="target model directory")
    p.add_argument(
        "--prompts",
        action="append",
        required=True,
        metavar="[NAME=]PATH",
        help="a prompt set, repeatable: MT-Bench question.jsonl, HumanEval .jsonl(.gz), GSM8K "
        ".jsonl, or conversations (.jsonl / ShareGPT / .parquet); NAME labels it in the report "
        "(default: the format, or the file's name for conversations)",
    )
    p.add_argument("--out", type=Path, required=True, help="report directory (must not exist)")
    p.add_argument(
        "--split",
        default="heldout",
        help="use rows whose 'split' equals this ('none' to ignore the field)",
    )
    p.add_argument(
        "--heldout-sources",
        type=Path,
        help="JSON list of held-out source files, or an object with 'heldout_sources'",
    )
    p.add_argument("--allow-unverified-prompts", action="store_true")
    p.add_argument("--limit", type=int, help="at most this many prompts per set (a stable spread)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    p.add_argument("--temperature", type=float, action="append", help="repeatable; default 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--no-baseline", action="store_true", help="skip the run without the draft")
    p.add_argument("--ignore-lineage", action="store_true")
    p.add_argument("--no-figure", action="store_true")
    p.add_argument(
        "--no-card",
        action="store_true",
        help="leave the draft's model card (DRAFT/README.md) as it is; by default this run's "
        "acceptance table goes into it, replacing the table of the same setting",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the Python code the target ships (auto_map; Kimi's tokenizer); without it "
        "such a target is refused before any work",
    )
    p.add_argument(
        "--chat-template-kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to the chat template when prompts are rendered (VALUE parsed as JSON), "
        "e.g. thinking=false for Kimi's instant mode: render prompts as the data was rendered; "
        "a row's own 'tools' and 'mode' override them for its prompt (reports give each kind)",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3-eval",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("offline", help="simulated chain drafting on held-out hidden states")
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--hidden-states", type=Path, required=True, help="held-out dataset dir")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--temperature", type=float, action="append")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-samples", type=int)
    p.add_argument("--target-rms-norm-eps", type=float)
    p.add_argument("--ignore-lineage", action="store_true")
    p.add_argument("--skip-validation", action="store_true", help="trust the dataset unread")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--no-figure", action="store_true")

    p = sub.add_parser("reference", help="speculative decoding with transformers (no vLLM)")
    _online_arguments(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--draft-proposal",
        default="greedy",
        choices=["greedy", "sample"],
        help="greedy: draft argmax, as vLLM; sample: draw from the draft at the temperature",
    )
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="continuations drawn per prompt at a temperature > 0, each with its own seed "
        "(--seed + its index among all draws; the first draw of each prompt is the one drawn "
        "without this option); one at temperature 0",
    )
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", default="cpu", help="where target and draft run (cpu, cuda)")

    p = sub.add_parser("vllm", help="speculative decoding in vLLM, its own counters")
    _online_arguments(p)
    p.add_argument("--vllm-python", help="python with vLLM (default: $EAGLE3_VLLM_PYTHON)")
    p.add_argument("--concurrency", type=int, default=1, help="prompts per generate call")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="vllm.LLM argument (VALUE parsed as JSON when it can be), e.g. dtype=bfloat16",
    )

    p = sub.add_parser("report", help="print a report as a table; validate; re-render")
    p.add_argument("report", type=Path)
    p.add_argument("--figure", action="store_true", help="(re)write acceptance.png")

    p = sub.add_parser("compare", help="two reports side by side")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)

    p = sub.add_parser("vllm-engine", help="internal: the vLLM child process")
    p.add_argument("job", type=Path)
    p.add_argument("result", type=Path)
    return parser


def _online_config(args: argparse.Namespace):
    from eagle3_eval.config import DraftSource, OnlineConfig, parse_engine_args
    from eagle3_eval.prompts import PromptSelection, PromptSource
    from eagle3_schemas.runtime.options import config_from_args

    selection = config_from_args(
        PromptSelection,
        args,
        sources=tuple(PromptSource.parse(p) for p in args.prompts),
        split=None if args.split.lower() == "none" else args.split,
        allow_unverified=args.allow_unverified_prompts,
    )
    # each mode's own options (reference: dtype, device...; vllm: vllm_python, concurrency) by name
    engine = {"engine_args": parse_engine_args(args.engine_arg)} if args.command == "vllm" else {}
    return config_from_args(
        OnlineConfig,
        args,
        drafts=tuple(DraftSource.parse(d) for d in args.draft),
        prompts=selection,
        temperatures=tuple(args.temperature or [0.0]),
        baseline=not args.no_baseline,
        chat_template_kwargs=parse_engine_args(args.chat_template_kwarg, "--chat-template-kwarg"),
        **engine,
    )


def _publish(
    results: list,
    out: Path,
    temperatures: tuple[float, ...],
    figure: bool,
    card_of: Path | None = None,
) -> list:
    """Write each report, print it and return it as read back; with ``card_of`` (online
    modes) put its acceptance table into that draft's model card (README.md), replacing the
    table of the same setting."""
    from eagle3_eval.config import output_dirs
    from eagle3_eval.report import format_table as table
    from eagle3_eval.report import read_report, write_report
    from eagle3_schemas.layouts.model_card import update_card

    reports = []
    for result, path in zip(results, output_dirs(out, temperatures), strict=True):
        write_report(result, path, figure=figure)
        report = read_report(path)
        reports.append(report)
        print(table(report))
        if card_of is not None:
            card = update_card(card_of, report.fields)
            print(
                f"model card: {card} holds this table"
                if card
                else f"model card: none at {card_of}/README.md (eagle3-train --card-only writes one)"
            )
    return reports


def _run(args: argparse.Namespace) -> int:
    command = args.command
    if command == "vllm-engine":
        from eagle3_eval.vllm_engine import main as engine_main

        return engine_main([str(args.job), str(args.result)])

    from eagle3_eval.config import ConfigError
    from eagle3_schemas.contract.paths import check_input_artifact

    if command == "offline":
        from eagle3_eval.config import OfflineConfig
        from eagle3_eval.offline import run_offline
        from eagle3_schemas.runtime.options import config_from_args

        temperatures = tuple(args.temperature or [0.0])
        config = config_from_args(OfflineConfig, args, temperatures=temperatures)
        config.check_paths()
        _publish(run_offline(config), config.out, config.temperatures, not args.no_figure)
        return 0
    if command in ("reference", "vllm"):
        from eagle3_eval.online import prepare

        config = _online_config(args)
        config.check_paths()
        inputs = prepare(config, served_by_vllm=command == "vllm")
        if command == "reference":
            from eagle3_eval.reference import run_reference

            results = run_reference(inputs)
        else:
            from eagle3_eval.vllm_mode import run_vllm

            results = run_vllm(inputs)
        outputs = config.draft_outputs()
        reports = {}
        for draft in config.drafts:
            card_of = None if args.no_card else draft.path
            reports[draft.name] = _publish(
                results[draft.name],
                outputs[draft.name],
                config.temperatures,
                not args.no_figure,
                card_of,
            )
        if len(reports) > 1:
            from eagle3_eval.table import TABLE_MD, markdown, write_table

            table = write_table(reports, config.out, figure=not args.no_figure)
            print(markdown(table))
            print(f"table: {config.out / TABLE_MD} (and .json, .png)")
        return 0
    if command == "report":
        from eagle3_eval.plot import render
        from eagle3_eval.report import format_table, read_report
        from eagle3_schemas.contract.validate import validate

        check_input_artifact(args.report, "eval_report", "REPORT")
        violations = validate(args.report)
        for v in violations:
            print(f"INVALID {v}", file=sys.stderr)
        if args.figure:
            print(f"wrote {render(args.report)}")
        print(format_table(read_report(args.report)))
        return 1 if violations else 0
    if command == "compare":
        from eagle3_eval.report import compare_table, read_report

        check_input_artifact(args.a, "eval_report", "REPORT_A")
        check_input_artifact(args.b, "eval_report", "REPORT_B")
        print(compare_table(read_report(args.a), read_report(args.b)))
        return 0
    raise ConfigError(f"unknown command {command!r}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "vllm-engine":
        return _run(args)  # errors go to the parent with the full traceback
    from eagle3_eval.config import ConfigError
    from eagle3_eval.draft_spec import DraftFormatError
    from eagle3_eval.preflight import PreflightError
    from eagle3_eval.prompts import PromptError
    from eagle3_eval.report import ReportError
    from eagle3_eval.target import TargetError
    from eagle3_eval.vllm_mode import VllmError
    from eagle3_schemas.contract.header import ArtifactError
    from eagle3_schemas.contract.paths import PathArgumentError
    from eagle3_schemas.io.diskspace import EXIT_DISK_FULL, DiskFull
    from eagle3_schemas.layouts.remote_code import RemoteCodeRefused

    try:
        return _run(args)
    except DiskFull as e:  # every file written is whole or absent; rerun once space is freed
        print(f"eagle3-eval {args.command}: disk full: {e}", file=sys.stderr)
        return EXIT_DISK_FULL
    except (
        ConfigError,
        DraftFormatError,
        PreflightError,
        PromptError,
        ReportError,
        TargetError,
        VllmError,
        ArtifactError,
        PathArgumentError,
        RemoteCodeRefused,
        FileNotFoundError,
    ) as e:
        print(f"eagle3-eval {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
