"""The recipe `eagle3-recipe new` writes for each public target passes every stage's preflight on
CPU, on a stand-in of that target: all eleven (tests/fixtures/public_targets), the MLA + MoE ones
(DeepSeek-V3, Kimi-K2.5: remote code, ``--trust-remote-code`` in every stage's flags) included.

`new` reads the published config.json (no weights) and writes flags.sh and train.yaml; the stages
then run with exactly those arrays and that config on a stand-in built from the same facts
(tests/support/public_standins.py), as tests/test_recipes.py runs the committed recipes
(tests/support/recipe_stages.py): ingest → tokenize + vocab → `eagle3-extract preflight` and
`run` (transformers backend) → `eagle3-train --preflight` (a forward and backward of the draft).

Each stand-in is built once per module and shared by the tests that use it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from eagle3_recipe.cli import main as recipe_main
from eagle3_recipe.plan import Request, make_plan

from support import doc_commands, public_standins, public_targets, recipe_stages, recipes

# The stages' CLIs run in this process, but tokenize and the stand-ins' builders start processes.
pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("ingest", "tokenize", "vocab", "extract preflight", "extract run", "train preflight")
# The node each target is planned on: 8 H100s, or 8 H200s for the MLA targets, whose weights
# (DeepSeek-V3 fp8 689 GB, Kimi-K2.5 int4 594 GB) do not fit one node of H100s. Their stand-ins
# (the full 129k / 164k vocabularies at hidden 128; Kimi's BPE learned at build time) take
# 30-50 s each on 2 cores: those two are `slow` too.
MLA_TARGETS = {"DeepSeek-V3", "Kimi-K2.5"}
PLANNED = [
    pytest.param(name, marks=pytest.mark.slow) if name in MLA_TARGETS else name
    for name in public_targets.PLANNED
]


def gpu_for(name: str) -> str:
    return "h200" if name in MLA_TARGETS else "h100"


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The stand-in of a public target, built on first use and shared by this module's tests."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("standins")

    def get(name: str) -> Path:
        if name not in built:
            built[name] = public_standins.build(name, root / name)
        return built[name]

    return get


def knobs(name: str, work: Path) -> dict[str, str]:
    """flags.sh's device-count knob at its smallest: one GPU, or one engine's TP where the
    weights need several (Llama-3.1-70B on H100s: TP 4; flags.sh refuses fewer)."""
    plan = make_plan(Request(public_targets.model_dir(name, work / "facts"), gpu_for(name)))
    tp = plan.value("extraction").tp
    return {**recipe_stages.CPU_KNOBS, "NGPU": str(tp if tp < plan.gpus else 1)}


def new_recipe(name: str, work: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> Path:
    """`eagle3-recipe new` on the public config, in a repository holding what `new` looks for;
    the recipe folder."""
    repo = work / "repo"
    (repo / "recipes" / "llama-3.1-8b").mkdir(parents=True)
    (repo / "recipes" / "llama-3.1-8b" / "pipeline.sh").write_text("#!/usr/bin/env bash\n")
    facts = public_targets.model_dir(name, work / "facts")
    monkeypatch.chdir(repo)
    argv = ["new", "--target", str(facts), "--gpu", gpu_for(name), "--name", "mine", *extra]
    assert recipe_main(argv) == 0
    return repo / "recipes" / "mine"


@pytest.mark.parametrize("name", PLANNED)
def test_a_generated_recipe_passes_every_stages_preflight(
    name: str,
    standin: Callable[[str], Path],
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = new_recipe(name, tmp_path, monkeypatch)
    (tmp_path / "work").mkdir()
    # Kimi-K2.5's is the session's (tests/conftest.py), which tests/test_kimi_recipe.py reads too.
    model = request.getfixturevalue("kimi_standin_dir") if name == "Kimi-K2.5" else standin(name)
    run = recipe_stages.run_stages(name, tmp_path / "work", folder, model, knobs(name, tmp_path))
    check_passed(run)


def check_passed(run: recipe_stages.StagesRun) -> None:
    """Every stage exited 0: each conversation tokenized, no preflight finding an error, the
    train preflight's forward and backward run."""
    for stage in STAGES:
        recipe_stages.passed(run, stage)
    written = run.outcomes["tokenize"].summary()["written"]
    assert written == len(recipe_stages.CONVERSATIONS), run.outcomes["tokenize"].stdout
    assert "[error" not in run.outcomes["extract preflight"].stdout
    report = run.outcomes["train preflight"].log
    assert "0 error(s)" in report and "dry_run: forward+backward" in report, report[-3000:]


# ---- several nodes -----------------------------------------------------------------------------

MULTINODE_DOC = ROOT / "docs" / "multinode.md"
# The docs' multi-node example: Llama-3.1-8B, 2 nodes of 8 GPUs (H100s, as its recipe).
DOC_TARGET, DOC_NODES, DOC_GPUS = "Llama-3.1-8B-Instruct", 2, 8
MASTER = "10.0.0.1"
STUB = """#!{python}
# A stage's command, stubbed: logs its words and writes what --out names (a file for
# eagle3-data, a folder otherwise; eagle3-eval's with the report the pipeline prints).
import json, os, pathlib, sys

name, args = pathlib.Path(sys.argv[0]).name, sys.argv[1:]
record = {{"node": os.environ.get("NODE_RANK", os.environ.get("NODE")), "cmd": name,
          "args": args, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}}
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
if "--out" in args and args[0] != "plan":  # plan only names the folder it sizes
    out = pathlib.Path(args[args.index("--out") + 1])
    if name == "eagle3-data":
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("")
    else:
        out.mkdir(parents=True, exist_ok=True)
    if name == "eagle3-eval":
        report = {{"per_position_acceptance": [0.5], "num_speculative_tokens": 3,
                  "acceptance_length": 1.5, "num_prompts": 1, "speedup": 1.0,
                  "tokens_per_second": 1.0, "baseline_tokens_per_second": 1.0}}
        (out / "report.json").write_text(json.dumps(report))
"""


def stub_bin(folder: Path) -> Path:
    """uv, python and the stages' commands as stubs (python is this interpreter)."""
    folder.mkdir()
    for name in ("eagle3-data", "eagle3-extract", "eagle3-eval", "accelerate", "vllm"):
        (folder / name).write_text(STUB.format(python=sys.executable))
        (folder / name).chmod(0o755)
    (folder / "python").write_text(f'#!/usr/bin/env bash\nexec "{sys.executable}" "$@"\n')
    (folder / "python").chmod(0o755)
    # `uv sync` does nothing; `uv run ... python -c ...` (the pipeline asks for its bin folder).
    (folder / "uv").write_text(f'#!/usr/bin/env bash\n[ "$1" = sync ] || echo "{folder}"\n')
    (folder / "uv").chmod(0o755)
    return folder


def records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def options(args: list[str]) -> set[tuple[str, str | None]]:
    pairs, i = set(), 0
    while i < len(args):
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        pairs.add((args[i], value))
        i += 2 if value is not None else 1
    return pairs


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`eagle3-recipe new --nodes 2` for the docs' example, in a repository holding the shared
    pipeline.sh and recipe_targets.py it runs."""
    work = tmp_path_factory.mktemp("two-nodes")
    repo = work / "repo"
    (repo / "recipes" / "llama-3.1-8b").mkdir(parents=True)
    shutil.copy(
        ROOT / "recipes" / "llama-3.1-8b" / "pipeline.sh", repo / "recipes" / "llama-3.1-8b"
    )
    shutil.copy(ROOT / "recipes" / "recipe_targets.py", repo / "recipes")
    facts = public_targets.model_dir(DOC_TARGET, work / "facts")
    argv = ["new", "--target", str(facts), "--gpu", "h100", "--gpus", str(DOC_GPUS)]
    argv += ["--nodes", str(DOC_NODES), "--name", "mine"]
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(repo)
        assert recipe_main(argv) == 0
    return repo / "recipes" / "mine"


def test_two_nodes_train_with_the_planners_step_and_lrs(two_nodes: Path) -> None:
    """16 GPUs: 131,072 tokens per step, the lrs x sqrt(2) (the planner's rule for GPUs x
    nodes); flags.sh keeps that step on NGPU x NODES GPUs."""
    config = yaml.safe_load((two_nodes / "train.yaml").read_text())
    assert (config["train"]["lr"], config["train"]["muon"]["lr"]) == (1.4e-4, 4.2e-4)
    batch = config["data"]["max_tokens_per_batch"]
    assert 16 * batch * config["train"]["gradient_accumulation_steps"] == 131072
    knobs = {"NODE_RANK": "0", "MASTER_ADDR": MASTER}
    flags = recipes.stage_flags(two_nodes, knobs, ("PLANNED_GPUS", "NODES"))
    assert flags == {"PLANNED_GPUS": ["16"], "NODES": ["2"]}
    # Without NODE_RANK or MASTER_ADDR, flags.sh (so pipeline.sh) stops and names it.
    for missing in knobs:
        with pytest.raises(subprocess.CalledProcessError) as refused:
            recipes.stage_flags(two_nodes, {k: v for k, v in knobs.items() if k != missing}, [])
        assert f"set {missing}" in refused.value.stderr


def _docs_extraction(work: Path, node: int, model: Path, shared: Path, stubs: Path) -> list[dict]:
    """docs/multinode.md's extraction loop, run by bash with eagle3-extract stubbed."""
    blocks = re.findall(r"```bash\n(.*?)```", MULTINODE_DOC.read_text(), flags=re.S)
    (loop,) = [b for b in blocks if "for ((g = 0" in b]
    log = work / f"docs-{node}.jsonl"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), "NODE": str(node)}
    env |= {"MODEL": str(model), "SHARED": str(shared)}
    subprocess.run(["bash", "-c", loop], env=env, check=True, timeout=60)
    return records(log)


def test_two_nodes_run_the_docs_launch(two_nodes: Path, tmp_path: Path) -> None:
    """pipeline.sh on two nodes at once (every command stubbed, the output folder shared): each
    node runs docs/multinode.md's extraction ranks and its `accelerate launch`; node 0 alone
    prepares the data, merges every rank once and evaluates."""
    stubs = stub_bin(tmp_path / "bin")
    model = public_targets.model_dir(DOC_TARGET, tmp_path / "model")
    out, log = tmp_path / "shared", tmp_path / "pipeline.jsonl"
    chats = tmp_path / "chats.jsonl"
    base = {"PATH": f"{stubs}:/usr/bin:/bin", "STUB_LOG": str(log), "MASTER_ADDR": MASTER}
    base |= {"MODEL": str(model), "DATA": str(chats), "HELDOUT": str(tmp_path / "held.jsonl")}
    base |= {"REGENERATE": "0", "AWAIT_SECONDS": "0.1", "HOME": str(tmp_path)}
    script = two_nodes / "pipeline.sh"
    runs = [
        subprocess.Popen(
            ["bash", str(script), str(out)],
            env={**base, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (1, 0)  # node 1 first: it waits for node 0's data
    ]
    for run in runs:
        stdout, _ = run.communicate(timeout=120)
        assert run.returncode == 0, stdout
    done = records(log)
    by = {}
    for r in done:
        by.setdefault((r["cmd"], r["args"][0]), []).append(r)

    # Node 0 alone: ingest, tokenize, vocab, merge, verify, eval.
    for key in [("eagle3-data", s) for s in ("ingest", "tokenize", "vocab")] + [
        ("eagle3-extract", "merge"),
        ("eagle3-extract", "verify"),
        ("eagle3-eval", "vllm"),
    ]:
        assert {r["node"] for r in by[key]} == {"0"}, key
    (merge,) = by[("eagle3-extract", "merge")]
    assert merge["args"][3:] == [str(out / "extract" / f"r{i}") for i in sorted(range(16), key=str)]

    # Extraction: the docs' loop on each node, rank for rank (the recipe's flags add
    # --gpu-memory-utilization; the pipeline's paths are the docs' $SHARED ones).
    docs_shared = tmp_path / "docs-shared"
    pipeline_runs = {
        r["args"][r["args"].index("--rank") + 1]: r for r in by[("eagle3-extract", "run")]
    }
    assert sorted(pipeline_runs, key=int) == [str(i) for i in range(16)]
    for node in range(DOC_NODES):
        for doc in _docs_extraction(tmp_path, node, model, docs_shared, stubs):
            rank = doc["args"][doc["args"].index("--rank") + 1]
            ours = pipeline_runs[rank]
            assert (ours["node"], ours["cuda"]) == (str(node), doc["cuda"]), rank
            wanted = {
                (k, v.replace(str(docs_shared), str(out)) if v else v)
                for k, v in options(doc["args"][1:])
            }
            assert wanted <= options(ours["args"][1:]), (rank, wanted - options(ours["args"][1:]))

    # Training: every node, the docs' accelerate launch with its own machine rank.
    (doc_launch,) = doc_commands.commands(
        MULTINODE_DOC,
        ("accelerate",),
        {"MASTER": MASTER, "SHARED": str(out), "MODEL": str(model)},
    )
    module = doc_launch.index("-m")
    launches = {r["node"]: r["args"] for r in by[("accelerate", "launch")]}
    assert sorted(launches) == ["0", "1"]
    for node, args in launches.items():
        at = args.index("-m")
        docs = [*doc_launch[2:module]]
        docs[docs.index("--machine_rank") + 1] = node
        assert options(args[1:at]) == options(docs), node
        # The training command: the docs' overrides, this recipe's train.yaml.
        train = options(args[at + 2 :])
        assert {p for p in options(doc_launch[module + 2 :]) if p[0] != "--config"} <= train
        assert ("--config", "recipes/mine/train.yaml") in train


def test_a_two_node_recipe_passes_every_stages_preflight(
    two_nodes: Path, standin: Callable[[str], Path], tmp_path: Path
) -> None:
    """The 2-node recipe's flags and train.yaml (its lrs for 16 GPUs) on the Llama-3.1-8B
    stand-in, as node 1 sources them."""
    knobs = {**recipe_stages.CPU_KNOBS, "NODE_RANK": "1", "MASTER_ADDR": MASTER}
    run = recipe_stages.run_stages("mine", tmp_path, two_nodes, standin(DOC_TARGET), knobs)
    check_passed(run)
