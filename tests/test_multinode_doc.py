"""docs/multinode.md's and docs/streaming.md's commands parse with the stages' own
argument parsers; the multi-node Accelerate config is the single-node ZeRO-2 recipe plus the
machine fields; the training commands' configs load with their overrides.

The commands cannot run here (one machine, no GPU); what can rot silently is the text: a
renamed flag, a stage name, a config field. The training command itself runs in CI as two
machines on one host (packages/eagle3-train/tests/test_launch.py).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from accelerate.commands.launch import launch_command_parser

from eagle3_extract.cli import build_parser as extract_parser
from eagle3_train.cli import build_parser as train_parser

from support.doc_commands import commands

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "multinode.md"
STREAMING = REPO / "docs" / "streaming.md"


def _commands(doc: Path = DOC, values: dict[str, str] | None = None) -> list[list[str]]:
    """Each eagle3-extract and accelerate command line of the page's bash blocks."""
    return commands(doc, ("eagle3-extract", "accelerate"), values)


def test_the_page_holds_the_commands_it_describes() -> None:
    stages = sorted({(w[0], w[1]) for w in _commands()})
    assert stages == [
        ("accelerate", "launch"),
        ("eagle3-extract", "merge"),
        ("eagle3-extract", "run"),
        ("eagle3-extract", "verify"),
    ]


# Paths a reader fills in, as strings (a bare "1" would read as a number in a --set value).
PATHS = {"MODEL": "/models/target", "SHARED": "/shared"}


def test_every_command_parses_with_the_stage_parsers() -> None:
    for words in _commands(values=PATHS):
        if words[0] == "eagle3-extract":
            args = extract_parser().parse_args(words[1:])
            if words[1] == "run":
                assert args.world_size >= 1 and args.backend == "vllm", words
            continue
        module = words.index("-m")
        launch = launch_command_parser().parse_args([*words[2:module], "x"])
        assert launch.num_machines == 2 and launch.machine_rank is not None, words
        assert words[module + 1] == "eagle3_train"
        config = _train_config(words[module + 2 :])
        # each --set landed where it says, over the recipe's train.yaml
        assert config.output_dir == "/shared/train"
        assert str(config.target.path) == "/models/target"
        assert str(config.data.hidden_states) == "/shared/hidden_states"
        assert str(config.data.vocab_map) == "/shared/vocab_map.safetensors"


def _train_config(argv: list[str]):
    """The config an eagle3-train command line runs with: its --config file loaded with its
    --set overrides and --output-dir, as eagle3_train.cli does (an unknown field or a
    malformed value fails here, not on the cluster)."""
    from eagle3_train.cli import parse_override
    from eagle3_train.config.run_config import load_config

    args = train_parser().parse_args(argv)
    overrides = [parse_override(o) for o in args.overrides]
    if args.output_dir:
        overrides.append({"output_dir": args.output_dir})
    return load_config(REPO / args.config, overrides)


def test_the_multinode_config_is_zero2_plus_the_machine_fields() -> None:
    accelerate_dir = REPO / "recipes" / "accelerate"
    multi = yaml.safe_load((accelerate_dir / "zero2_multinode.yaml").read_text())
    single = yaml.safe_load((accelerate_dir / "zero2.yaml").read_text())
    multi_ds, single_ds = multi.pop("deepspeed_config"), single.pop("deepspeed_config")
    assert multi_ds.pop("deepspeed_multinode_launcher") == "standard"  # torchrun, not pdsh
    assert multi_ds == single_ds
    machine_fields = {"num_processes", "num_machines", "main_process_port"}
    assert {k: v for k, v in multi.items() if k not in machine_fields} == {
        k: v for k, v in single.items() if k not in machine_fields
    }
    assert multi["num_machines"] == 2 and multi["num_processes"] == 16


def test_the_streaming_commands_parse_and_their_config_loads() -> None:
    from eagle3_train.cli import parse_override
    from eagle3_train.config.run_config import load_config

    commands = _commands(STREAMING)
    assert sorted((w[0], w[1]) for w in commands) == [
        ("accelerate", "launch"),
        ("eagle3-extract", "run"),
    ]
    for words in commands:
        if words[0] == "eagle3-extract":
            args = extract_parser().parse_args(words[1:])
            assert args.stream and args.disk_budget == 2 * 10**12 and args.backend == "vllm"
            continue
        module = words.index("-m")
        launch_command_parser().parse_args([*words[2:module], "x"])
        args = train_parser().parse_args(words[module + 2 :])
        assert args.reclaim
        config = load_config(
            REPO / args.config,
            [*map(parse_override, args.overrides), {"data": {"reclaim": args.reclaim}}],
        )
        assert config.data.stream and config.data.order == "shard_window"
