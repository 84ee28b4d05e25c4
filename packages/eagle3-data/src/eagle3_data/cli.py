"""``eagle3-data``: chat data → conversations → tokenized samples → draft vocabulary.

    eagle3-data ingest RAW... --out conversations.parquet
    eagle3-data regenerate conversations.parquet --endpoint http://127.0.0.1:8000/v1 --model NAME --out regen.parquet
    eagle3-data tokenize conversations.parquet --tokenizer TARGET_DIR --out tokenized.parquet
    eagle3-data vocab tokenized.parquet --draft-vocab-size 32000 --out vocab_map.safetensors

Every output is validated against its schema before the command reports success.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from eagle3_data import ingest, regenerate, tokenization, vocab
from eagle3_data.config import (
    ConfigError,
    IngestConfig,
    RegenerateConfig,
    SamplingConfig,
    TokenizeConfig,
    VocabConfig,
)
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.io.diskspace import EXIT_DISK_FULL, DiskFull
from eagle3_schemas.runtime.options import config_from_args
from eagle3_schemas.runtime.signals import EXIT_PREEMPTED


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eagle3-data",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "ingest",
        help="raw chat data (ShareGPT, OpenAI messages, Parquet, datasets dir) → conversations",
    )
    p.add_argument("inputs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rejects", type=Path, help="default: OUT.rejects.jsonl")
    p.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="keep only records whose top-level FIELD equals VALUE (e.g. split=train); "
        "repeated for one FIELD, any of its values (kind=thinking --keep kind=agent)",
    )

    p = sub.add_parser("regenerate", help="replace assistant turns with the target's own answers")
    p.add_argument("conversations", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--model", required=True, help="served model name (endpoint) or model path (--engine vllm)"
    )
    p.add_argument("--endpoint", help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--engine", choices=["endpoint", "vllm"], default="endpoint")
    p.add_argument("--rejects", type=Path)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--preempt-signals",
        default="SIGTERM",
        help="comma-separated signals that stop the run once the answers in flight are in, "
        "exit 5, rerun resumes (default SIGTERM; e.g. SIGTERM,SIGUSR1 for Slurm --signal)",
    )
    p.add_argument("--retries", type=int, default=4)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="first retry delay in seconds, doubled each retry",
    )
    p.add_argument(
        "--limit",
        type=int,
        help="only N conversations: the first N, or a random N with --sample-seed",
    )
    p.add_argument(
        "--sample-seed",
        type=int,
        help="with --limit: draw the N conversations at random with this seed (reproducible; "
        "the first N of a corpus sorted by source are a biased subset)",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="argument for vllm.LLM with --engine vllm (VALUE parsed as JSON when it can be), e.g. tensor_parallel_size=8",
    )

    p.add_argument(
        "--chat-template-kwarg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to the target's chat template with every request (VALUE parsed as JSON), "
        "e.g. thinking=false for Kimi's instant mode",
    )
    p.add_argument(
        "--thinking-fraction",
        type=float,
        help="regenerate this share of the rows in thinking mode and the rest in instant mode, "
        "drawn per row by a hash of --seed and its id (sets thinking and enable_thinking in the "
        "chat template kwargs); default: each row's own mode",
    )
    p.add_argument(
        "--keep-length-cut",
        action="store_true",
        help="keep answers cut at --max-tokens (counted in the summary) instead of rejecting them",
    )
    _trust_flag(p, "the model (--engine vllm)")
    p = sub.add_parser("tokenize", help="conversations → token ids + assistant-only loss masks")
    p.add_argument("conversations", type=Path)
    p.add_argument(
        "--tokenizer", type=Path, required=True, help="the target's tokenizer or model directory"
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rejects", type=Path)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--workers", type=int, default=2)
    _trust_flag(p, "the tokenizer")

    p = sub.add_parser("vocab", help="loss-token counts → draft vocabulary map (d2t, t2d)")
    p.add_argument("tokenized", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--draft-vocab-size", type=int, required=True)
    p.add_argument(
        "--target-vocab-size", type=int, help="default: the tokenized header's vocab_size"
    )
    return parser


def _trust_flag(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help=f"run the Python code {what} ships (auto_map; Kimi's tokenizer needs it); "
        "without it a directory with such code is refused before any work",
    )


def _key_value(text: str, flag: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"{flag} {text!r}: expected KEY=VALUE")
    return key, value


def _engine_arg(text: str, flag: str = "--engine-arg") -> tuple[str, object]:
    key, value = _key_value(text, flag)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _rejects(args: argparse.Namespace) -> Path:
    return args.rejects or args.out.with_name(args.out.name + ".rejects.jsonl")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "ingest":
            keep: dict[str, tuple[str, ...]] = {}
            for field, value in (_key_value(k, "--keep") for k in args.keep):
                keep[field] = (*keep.get(field, ()), value)
            summary = asdict(
                ingest.run(IngestConfig(args.inputs, args.out, _rejects(args), keep=keep))
            )
        elif args.command == "regenerate":
            config = config_from_args(
                RegenerateConfig,
                args,
                output=args.out,
                rejects=_rejects(args),
                sampling=config_from_args(SamplingConfig, args),
                timeout_s=args.timeout,
                backoff_s=args.backoff,
                engine_args=dict(_engine_arg(a) for a in args.engine_arg)
                | ({"trust_remote_code": True} if args.trust_remote_code else {}),
                chat_template_kwargs=dict(
                    _engine_arg(a, "--chat-template-kwarg") for a in args.chat_template_kwarg
                ),
                preempt_signals=tuple(s for s in args.preempt_signals.split(",") if s.strip()),
            )
            summary = asdict(regenerate.run(config))
            if summary["preempted"]:
                print(json.dumps(summary), file=sys.stderr)
                print(
                    f"eagle3-data: preempted by {summary['preempted']}; every answer received "
                    f"is kept in {config.journal}; rerun the same command to resume",
                    file=sys.stderr,
                )
                return EXIT_PREEMPTED
            if not summary["published"]:
                print(json.dumps(summary), file=sys.stderr)
                print(
                    f"eagle3-data: {summary['failed']} samples failed after retries (see {config.rejects}.last-run.jsonl); "
                    f"completed samples are kept in {config.journal}; rerun the same command to retry",
                    file=sys.stderr,
                )
                return 1
        elif args.command == "tokenize":
            config = config_from_args(TokenizeConfig, args, output=args.out, rejects=_rejects(args))
            summary = asdict(tokenization.run(config))
        else:
            vocab_map = vocab.run(config_from_args(VocabConfig, args, output=args.out))
            summary = {
                "draft_vocab_size": len(vocab_map.d2t),
                "coverage": round(vocab_map.coverage, 6),
            }
    except (ConfigError, ValueError) as e:  # PathArgumentError included: bad usage, exit 2
        print(f"eagle3-data {args.command}: error: {e}", file=sys.stderr)
        return 2
    except DiskFull as e:  # what was written is kept whole; rerun resumes once space is freed
        print(f"eagle3-data {args.command}: disk full: {e}", file=sys.stderr)
        return EXIT_DISK_FULL
    violations = validate(args.out)
    output = args.out
    if violations:
        output = _set_aside(args.out)
        for v in violations:
            print(f"eagle3-data {args.command}: output violates its schema: {v}", file=sys.stderr)
        print(
            f"eagle3-data {args.command}: the invalid output was moved to {output}", file=sys.stderr
        )
    print(json.dumps({"command": args.command, "output": str(output), **summary}, default=str))
    return 1 if violations else 0


def _set_aside(path: Path) -> Path:
    """Move an output that fails its schema off the artifact's name: a later stage, or a
    script's ``[ -f OUT ] ||`` guard, would otherwise take it for a finished artifact."""
    aside = path.with_name(path.name + ".invalid")
    os.replace(path, aside)
    return aside


if __name__ == "__main__":
    sys.exit(main())
