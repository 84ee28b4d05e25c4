"""``eagle3-train``: arguments → Config → train(); nothing else.

Run it under Accelerate (any of these, from the repository root):

    accelerate launch eagle3-train --config recipes/tiny/train.yaml
    accelerate launch -m eagle3_train --config recipes/tiny/train.yaml
    accelerate launch --config_file recipes/accelerate/zero2.yaml eagle3-train --config ...

or alone (one process): ``eagle3-train --config ...``. ``--preflight`` runs the checks only;
``--card-only DRAFT`` rewrites an exported draft's model card (README.md) and nothing else.
Exit status: 0 done, 2 a config or preflight error, 3 a NaN stopped training, 4 the stream
being trained on failed (stalled producer, torn shard, shard reclaimed too early), 5 a
preemption signal (train.preempt_signals, SIGTERM by default) stopped it with a checkpoint
at a step boundary (rerun to resume), 6 a
sample's stored rows do not match their checksum (data.on_corrupt: stop), 7 a full disk
(the checkpoint, export or published draft did not fit; nothing half-written is kept), 8 a
collective with the other ranks failed (a rank died, or answered nothing for
train.collective_timeout_s). Under several ranks a fault one rank meets (6, 7, ...) is every
rank's status, the others naming that rank (causes.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from eagle3_schemas.contract.header import read_header
from eagle3_schemas.contract.paths import (
    PathArgumentError,
    artifact_noun,
    check_input_artifact,
    check_input_dir,
    check_input_file,
    check_output,
    refuse,
)
from eagle3_train.config.run_config import Config, ConfigError, load_config, parse_override

CONFIG_EXPECTED = "a YAML config file (e.g. recipes/tiny/train.yaml)"
OUTPUT_EXPECTED = "a directory of its own for the run (new, or an earlier run to resume)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="eagle3-train",
        description="Train an EAGLE-3 draft on a hidden-state dataset; export it for vLLM.",
    )
    p.add_argument("--config", required=True, help="YAML config (see recipes/tiny/train.yaml)")
    p.add_argument(
        "--preflight",
        action="store_true",
        help="only run the verify-before-run checks (inputs, lineage, interfaces, one batch, memory)",
    )
    p.add_argument("--no-preflight", action="store_true", help="skip the checks before training")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--max-steps", type=int, help="override train.max_steps")
    p.add_argument("--resume", help="override train.resume: auto | never | PATH")
    p.add_argument(
        "--reclaim",
        action="store_true",
        help="with data.stream: delete consumed shards once a checkpoint covers them",
    )
    p.add_argument(
        "--card-only",
        metavar="DRAFT",
        help="only (re)write DRAFT/README.md, the model card, from this config (keeps "
        "eagle3-eval's acceptance tables); no training",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set train.lr=3e-4 (repeatable)",
    )
    return p


def check_paths(config: Config, output_flag: str) -> None:
    """Refuse bad paths before the accelerator, trackers or inputs are touched.

    The output directory may exist: training resumes from its checkpoints. It must not be an
    artifact of another stage (a hidden-state dataset, a draft, a report): the run would write
    its checkpoints and exports into it.
    """
    if not config.data.stream:  # a stream's directory may not exist yet
        check_input_artifact(config.data.hidden_states, "hidden_states", "data.hidden_states")
    check_input_artifact(config.data.vocab_map, "vocab_map", "data.vocab_map")
    if config.target.path:
        target_expected = "a target model directory (with config.json)"
        check_input_dir(config.target.path, "target.path", target_expected, ("config.json",))
    if config.train.resume not in ("auto", "never"):
        resume_expected = "a checkpoint directory of an earlier run (with trainer_state.json)"
        check_input_dir(
            config.train.resume, "train.resume", resume_expected, ("trainer_state.json",)
        )
    out = Path(config.output_dir)
    check_output(out, output_flag, OUTPUT_EXPECTED, directory=True, may_exist=True)
    if out.is_dir():
        try:
            kind = read_header(out).artifact
        except ValueError:  # no header file: not an artifact, a run directory or a new one
            return
        refuse(output_flag, out, f"is {artifact_noun(kind)}", OUTPUT_EXPECTED)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        check_input_file(args.config, "--config", CONFIG_EXPECTED, (".yaml", ".yml"))
        overrides = [parse_override(o) for o in args.overrides]
        if args.output_dir:
            overrides.append({"output_dir": args.output_dir})
        if args.max_steps is not None:
            overrides.append({"train": {"max_steps": args.max_steps}})
        if args.resume:
            overrides.append({"train": {"resume": args.resume}})
        if args.reclaim:
            overrides.append({"data": {"reclaim": True}})
        if args.no_preflight:
            overrides.append({"train": {"preflight": False}})
        config = load_config(args.config, overrides)
        if args.card_only:
            check_input_artifact(args.card_only, "draft_checkpoint", "--card-only")
        else:
            check_paths(config, "--output-dir" if args.output_dir else "output_dir")
    except (ConfigError, PathArgumentError) as e:
        print(f"eagle3-train: config error: {e}", file=sys.stderr)
        return 2
    if args.card_only:
        from eagle3_train.export.card import write_model_card
        from eagle3_train.export.write import served_as

        draft = Path(args.card_only)
        card = draft / "README.md"
        print(f"wrote {write_model_card(draft, config, served_as(config, draft), card)}")
        return 0
    # (imported here: a config error is reported without loading torch)
    from eagle3_train.components.faults import exit_status
    from eagle3_train.run.trainer import train

    try:
        return train(config, preflight_only=args.preflight)
    except Exception as e:
        status = exit_status(e, config)
        if status is None:
            raise
        return status


if __name__ == "__main__":
    sys.exit(main())
