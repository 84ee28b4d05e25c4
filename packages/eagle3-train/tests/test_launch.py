"""Real multi-process launches on CPU, as a user types them: 2-process DDP, DeepSpeed ZeRO-2
and ZeRO-3 (gloo; DS_ACCELERATOR=cpu), with the recipes under recipes/accelerate/.

All three must reproduce, step by step, the losses of one process with gradient accumulation
2 (rank r of 2 reads batches r, r+2, ...; the single process accumulates the same pairs), and so
must a DDP launch with Muon (its Newton–Schulz shared out across the ranks).
Both launch forms are exercised: ``accelerate launch eagle3-train`` (bare name, from the
repository root) and ``accelerate launch -m eagle3_train``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_schemas.contract.validate import validate

from support.train import REPO, env_for_subprocess, make_inputs, run_cli, write_config

pytestmark = pytest.mark.distributed

STEPS = 6
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def _losses(run: Path) -> list[float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r.get("event") == "train"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("launch")
    inputs = make_inputs(root / "inputs", num_samples=40, min_len=24, max_len=96)
    sections = dict(train={"max_steps": STEPS, "save_every": 3, "log_every": 1, "epochs": 2})
    single = root / "single"
    config = write_config(
        inputs, single, train={**sections["train"], "gradient_accumulation_steps": 2}
    )
    result = run_cli(["--config", str(config)])
    assert result.returncode == 0, result.stderr[-3000:]
    reference = _losses(single)
    assert len(reference) == STEPS
    return inputs, sections, reference, root


def _launch(
    setup, name: str, recipe: str, form: list[str], deepspeed: bool, **changed: dict
) -> Path:
    inputs, sections, _, root = setup
    run = root / name
    config = write_config(inputs, run, **{**sections, **changed})
    env = env_for_subprocess()
    if deepspeed:
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [
        ACCELERATE,
        "launch",
        "--config_file",
        f"recipes/accelerate/{recipe}",
        *form,
        "--config",
        str(config),
    ]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"
    assert validate(run / "draft") == []
    return run


@pytest.mark.parametrize(
    ("name", "recipe", "form", "deepspeed"),
    [
        ("ddp", "ddp.yaml", ["eagle3-train"], False),
        ("zero2", "zero2.yaml", ["-m", "eagle3_train"], True),
        ("zero3", "zero3.yaml", ["eagle3-train"], True),
    ],
)
def test_two_process_run_matches_single_process_accumulation(setup, name, recipe, form, deepspeed):
    _, _, reference, _ = setup
    run = _launch(setup, name, recipe, form, deepspeed)
    losses = _losses(run)
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["world_size"] == 2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), rtol=2e-5, atol=1e-6)
    draft = load_file(str(run / "draft" / "model.safetensors"))
    single = load_file(str(setup[3] / "single" / "draft" / "model.safetensors"))
    for key in draft:
        torch.testing.assert_close(draft[key], single[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_two_process_muon_run_matches_single_process_accumulation(setup):
    """train.optimizer: muon under DDP, each matrix's Newton–Schulz on one rank and broadcast
    (components/sharded_muon.py): the launch trains as one process accumulating the same pairs."""
    inputs, sections, _, root = setup
    train = {**sections["train"], "optimizer": "muon"}
    single = root / "single-muon"
    config = write_config(inputs, single, train={**train, "gradient_accumulation_steps": 2})
    result = run_cli(["--config", str(config)])
    assert result.returncode == 0, result.stderr[-3000:]
    run = _launch(setup, "ddp-muon", "ddp.yaml", ["eagle3-train"], False, train=train)
    torch.testing.assert_close(
        torch.tensor(_losses(run)), torch.tensor(_losses(single)), rtol=2e-5, atol=1e-6
    )
    draft = load_file(str(run / "draft" / "model.safetensors"))
    reference = load_file(str(single / "draft" / "model.safetensors"))
    for key in draft:
        torch.testing.assert_close(draft[key], reference[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_one_process_cpu_launch_uses_every_core(setup):
    """`accelerate launch` exports OMP_NUM_THREADS=1 for a non-use_cpu config: the trainer's
    default spreads this machine's cores over its local processes instead (one process: all)."""
    import os

    inputs, sections, _, root = setup
    run = root / "threads"
    config = write_config(inputs, run, train={**sections["train"], "torch_threads": None})
    env = env_for_subprocess()
    env.pop("OMP_NUM_THREADS")
    cmd = [ACCELERATE, "launch", "--config_file", "recipes/accelerate/single.yaml"]
    cmd += ["-m", "eagle3_train", "--config", str(config)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    start = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert start["torch_threads"] == len(os.sched_getaffinity(0))


def test_two_machines_launch_as_recipes_multinode_says(setup):
    """docs/multinode.md's training command, on two "machines" of one process each on this
    host: the same `accelerate launch` with --machine_rank 0 and 1 and node 0's address (static
    rendezvous, torchrun per node, no pdsh). Same losses as one process accumulating 2."""
    inputs, sections, reference, root = setup
    run = root / "two-machines"
    config = write_config(inputs, run, **sections)
    env = {**env_for_subprocess(), "DS_ACCELERATOR": "cpu"}
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [ACCELERATE, "launch", "--config_file", "recipes/accelerate/zero2_multinode.yaml"]
    launch += ["--num_machines", "2", "--num_processes", "2"]  # one process per "machine"
    launch += ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    logs = [root / f"machine{rank}.log" for rank in (0, 1)]  # files: a full pipe would block
    nodes = []
    for rank in (0, 1):
        with logs[rank].open("w") as log:  # the child keeps its own descriptor
            command = [*launch, "--machine_rank", str(rank), "-m", "eagle3_train"]
            command += ["--config", str(config)]
            nodes.append(
                subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=log)
            )
    for rank, node in enumerate(nodes):
        node.wait(timeout=400)
        assert node.returncode == 0, f"machine {rank}:\n{logs[rank].read_text()[-4000:]}"
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["world_size"] == 2
    torch.testing.assert_close(
        torch.tensor(_losses(run)), torch.tensor(reference), rtol=2e-5, atol=1e-6
    )
    assert validate(run / "draft") == []
