"""tools/bench/bench_vs_speculators.py's readings at temperature > 0 (issue 45): each
temperature's figure is named and keyed apart from greedy's and from each other's, is read by
the reference loop with the samples and seed asked for, and the table says at what temperature
each row was read. The speculators arms resolve through speculators' own argument parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from support.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "bench" / "bench_vs_speculators.py"
RUNS = SCRIPT.with_name("tiny_runs.py")  # the tiny recipe's runs as the bench reads them


@pytest.fixture(scope="module")
def bench():
    return load_script(SCRIPT)


def test_each_temperature_is_named_and_keyed_apart(bench) -> None:
    greedy, hot, warm = bench.Sampling(), bench.Sampling(1.0, 4, 0), bench.Sampling(0.6, 4, 0)
    # greedy keeps the names and keys results were kept under before temperatures existed
    assert [bench.result_suffix(3, True, greedy), bench.result_suffix(5, False, greedy)] == [
        "",
        "-k5-reference",
    ]
    assert greedy.key() == {} and greedy.eval_args() == []
    names = {bench.result_suffix(k, False, s) for k in (3, 5) for s in (greedy, hot, warm)}
    assert len(names) == 6
    assert bench.result_suffix(3, False, hot) == "-T1-reference"
    assert bench.result_suffix(5, False, warm) == "-k5-T0.6-reference"
    # the same temperature with other draws is another key (the file is then measured again)
    assert hot.key() != bench.Sampling(1.0, 8, 0).key() != bench.Sampling(1.0, 8, 1).key()
    # drafts drawn from (accepted with 1 - TV) against the argmax proposal: named apart too,
    # while the argmax proposal keeps the key its readings were kept under
    drawn = bench.Sampling(1.0, 4, 0, "sample")
    assert bench.result_suffix(3, False, drawn) == "-T1-draft-sampled-reference"
    assert "draft_proposal" not in hot.key() and drawn.key()["draft_proposal"] == "sample"


def test_a_sampled_reading_asks_the_reference_loop_for_its_draws(bench, tmp_path: Path) -> None:
    recipe = bench.Recipe(ROOT / "recipes" / "tiny")
    args = (recipe, tmp_path, tmp_path / "draft", tmp_path / "eval", 40, 3)
    sampled = bench.eval_command(*args, None, bench.Sampling(1.0, 4, 7))
    assert sampled[4] == "reference"
    i = sampled.index("--temperature")
    expected = [
        "--temperature",
        "1.0",
        "--samples",
        "4",
        "--seed",
        "7",
        "--draft-proposal",
        "greedy",
    ]
    assert sampled[i : i + 8] == expected
    assert {"--split", "--heldout-sources"} <= set(sampled)  # the held-out proof is kept
    greedy = bench.eval_command(*args, "/usr/bin/python3", bench.Sampling())
    assert greedy[4] == "vllm" and "--temperature" not in greedy
    with pytest.raises(ValueError, match="cannot read sampled acceptance"):
        bench.eval_command(*args, "/usr/bin/python3", bench.Sampling(1.0, 4, 0))


def test_a_kept_reading_stands_only_for_its_own_temperature(
    bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One trained draft, read at T = 0.6 already: T = 0.6 reuses it, T = 1 is measured anew
    (by the reference loop, whatever --evaluator says) and the 0.6 reading is left alone."""
    recipe = bench.Recipe(ROOT / "recipes" / "tiny")
    measured: list[list[str]] = []

    def evaluate(command: list[str], out: Path) -> dict:
        """eagle3-eval's report, as far as the bench reads it (the loop itself is tested in
        packages/eagle3-eval); the command it was asked is kept."""
        measured.append(command)
        t = float(command[command.index("--temperature") + 1])
        return {
            "mode": command[4],
            "temperature": t,
            "acceptance_length": 2.0 + t,
            "per_position_acceptance": [0.5, 0.3, 0.2],
        }

    monkeypatch.setattr(bench, "evaluate", evaluate)

    def args(temperature: float):
        return argparse.Namespace(
            steps=150,
            lr=1e-3,
            k=3,
            prompts=40,
            evaluator="auto",
            vllm_python="python3",
            sampling=bench.Sampling(temperature, 4, 0),
        )

    where = tmp_path / "bench" / "tv" / "seed-0"
    where.mkdir(parents=True)
    overrides = ["train.objective.divergence=tv"]
    train_key = {"steps": 150, "lr": 1e-3, "overrides": overrides}
    train_key["code"] = bench.code_fingerprint(recipe)
    (where / "trained.json").write_text(json.dumps({"key": train_key, "run_seconds": 9.0}))
    run = tmp_path / "run"
    first = bench.run_arm(args(0.6), recipe, run, tmp_path / "bench", "tv", overrides, 0)
    again = bench.run_arm(args(0.6), recipe, run, tmp_path / "bench", "tv", overrides, 0)
    assert len(measured) == 1 and again == first and first["temperature"] == 0.6
    hot = bench.run_arm(args(1.0), recipe, run, tmp_path / "bench", "tv", overrides, 0)
    assert len(measured) == 2 and hot["temperature"] == 1.0 and hot["evaluator"] == "reference"
    assert sorted(p.name for p in where.glob("result*.json")) == [
        "result-T0.6-reference.json",
        "result-T1-reference.json",
    ]
    assert json.loads((where / "result-T0.6-reference.json").read_text()) == first
    summary = bench.summarize_arm([hot], lambda steps: 1, 3)
    assert summary["temperature"] == 1.0
    with pytest.raises(ValueError, match="several temperatures"):
        load_script(RUNS).temperature_of([first, hot])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        (["--temperature", "1", "--samples", "0"], "--samples must be >= 1, got 0"),
        (["--draft-proposal", "sample"], "--draft-proposal sample needs a --temperature > 0"),
        (["--temperature", "1", "--draft-proposal", "top"], "--draft-proposal 'top': greedy or"),
    ],
)
def test_bad_sampling_is_refused(
    bench, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("arm", "loss"),
    [("speculators-muon-lr5e-3", "kl_div"), ("speculators-muon-lr5e-3-lk_hybrid", "lk_hybrid")],
)
def test_speculators_arms_resolve_through_its_own_parser(bench, arm: str, loss: str) -> None:
    from speculators.train.config.resolution import resolve
    from speculators.train.config.schema import TrainConfig

    argv = ["--verifier-name-or-path", str(ROOT / "recipes" / "tiny" / "target")]
    argv += ["--speculator-type", "eagle3", "--lr", "1e-3", "--max-steps", "150"]
    cli = resolve(TrainConfig, [*argv, *bench.SPECULATORS_ARMS[arm]])
    assert cli.loss.loss_fn == loss
    assert cli.optimizer.muon_lr == 5e-3


def test_an_arm_accumulating_batches_counts_their_tokens(bench) -> None:
    """tokens/s of an arm with train.gradient_accumulation_steps N: N packed batches a step."""
    assert (
        bench.micro_batches_per_step(["train.gradient_accumulation_steps=4", "train.lr=2e-3"]) == 4
    )
    assert bench.micro_batches_per_step(["train.lr=2e-3"]) == 1
    assert bench.micro_batches_per_step([]) == 1


@pytest.mark.process
def test_ours_trains_the_steps_asked_past_the_recipes_epochs(tmp_path: Path) -> None:
    """--steps beyond the recipe's train.epochs (tiny: 4 epochs, ~310 steps, against 600): the
    bench's sets make eagle3-train take every step, as speculators' loop does; the recipe's
    epochs alone (the negative control) stop it at the end of its last epoch."""
    from support.train import make_inputs, run_cli, write_config

    runs = load_script(RUNS)
    inputs = make_inputs(tmp_path / "run", num_samples=96)  # ~2 batches of 2048 tokens an epoch
    steps, seed = 5, 0
    per_epoch = len(runs.epoch_plans(inputs.hidden_states, 1, seed)[0])
    assert 1 < per_epoch < steps  # one epoch is too few, as 4 are for tiny at 600 steps
    data = {"validation_fraction": runs.VALIDATION_FRACTION}
    data |= {"max_tokens_per_batch": runs.MAX_TOKENS}
    taken = {}
    for name, sets in {
        "recipe's epochs": [],
        "bench": runs.ours_sets(inputs.root, steps, 1e-3, seed, []),
    }.items():
        out = tmp_path / name.replace("'", "").replace(" ", "-")
        config = write_config(inputs, out, data=data, train={"epochs": 1, "max_steps": None})
        args = ["--config", str(config), "--output-dir", str(out), "--max-steps", str(steps)]
        result = run_cli([*args, *(x for s in sets for x in ("--set", s))])
        assert result.returncode == 0, result.stderr[-2000:]
        taken[name] = runs.trained_steps(out / "metrics.jsonl")
    assert taken == {"recipe's epochs": per_epoch, "bench": steps}


def test_a_run_that_did_not_finish_is_refused(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"event": "train", "step": 10}) + "\n")
    with pytest.raises(SystemExit, match="no 'done' event"):
        load_script(RUNS).trained_steps(metrics)
