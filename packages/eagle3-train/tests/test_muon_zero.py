"""train.optimizer: muon under DeepSpeed ZeRO-2 (2 processes on CPU, gloo, DS_ACCELERATOR=cpu):
DeepSpeed's own Muon, set up by build.make_deepspeed_muon, steps as torch.optim.Muon does in one
process with gradient accumulation 2 (rank r of 2 reads batches r, r+2, ...; the single process
accumulates the same pairs), and a ZeRO-2 run saved and resumed continues exactly.

Twice: unclipped (the single process runs with a max_grad_norm its gradients never reach,
asserted; ZeRO-2 with 0), and with train.max_grad_norm CLIP active, where the single process
clips the gradient before torch's Muon and ZeRO-2 clips it before DeepSpeed's Newton–Schulz
(components/zero_clip.py). Negative control: the clip left out under ZeRO-2 fails the momentum
comparison below. Planted once each and caught: zero_clip clipping after Newton–Schulz (momentum
13-28 % off, 5 matrices' weights beyond tolerance), and DeepSpeed's own gradient_clipping in
its place (which clips the orthogonalised update: here never, as its norm stays below CLIP, so
it fails as the control does).

The tolerance. The one difference left in the rule is Newton–Schulz's rounding: both run the
same quintic iteration in bf16, but torch fuses ``b·A + c·A·A`` and ``a·X + B·X`` into addmm
where DeepSpeed rounds each product and sum, and the iteration amplifies what rounding leaves in
a gradient's small singular directions (as much as torch's own iteration differs on the same
matrix rescaled by 1-3 %: asserted). δ(shape) = ||NS_torch(M) - NS_deepspeed(M)||_F, measured
on the single run's own Muon momentum buffers (steps 3 and 6, the matrices the rule really sees).
Each step moves a matrix by lr·0.2·sqrt(max side)·NS(...), so after STEPS steps the two differ by
at most STEPS·lr·0.2·sqrt(max side)·δ from the rounding, and again as much as the changed weights
feed back into later gradients: tolerance = 2·STEPS·lr·0.2·sqrt(max side)·δ(shape) (Frobenius).
AdamW's tensors (norms, LM head) step by torch's AdamW on both sides and differ only through that
feedback from the Muon matrices: none may differ by more than the largest Muon tolerance (a
stated bound, not a derived one).

The clip shows in the weights only as far as its factor changes from step to step (Newton–Schulz
and AdamW undo a constant one), well inside that tolerance here, but it shows whole in Muon's
momentum, the sum of the clipped gradients: with the clip, each Muon matrix's momentum after
STEPS steps is the single process's within MOMENTUM_BOUND (relative, Frobenius; measured
0.2-1.0 %), and without it 12-18 % off (the single process's own clipped against unclipped
momentum: 12-18 %). MOMENTUM_BOUND is a stated bound between the two.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle3_train.components.build import VOCABULARY_ROWS

from support.train import REPO, env_for_subprocess, make_inputs, run_cli, write_config

pytestmark = pytest.mark.distributed

STEPS = 6
LR = 5e-3
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
RESCALE = (0.97, 1.01, 1.03)
NEVER_REACHED = 1e6  # a max_grad_norm no gradient here comes near: torch's side never clips
# Below most of these steps' gradient norms (measured unclipped: 333, 333, 311, 276, 244, 243),
# so that the clip's factor changes from step to step: a constant factor would barely show
# (Muon's Newton–Schulz and AdamW both undo a constant scale of the gradient)
CLIP = 250.0
MOMENTUM_BOUND = 0.03


def _train(settings: dict) -> dict:
    return {
        "optimizer": "muon",
        "max_steps": STEPS,
        "save_every": 3,
        "keep_checkpoints": 3,
        "log_every": 1,
        "epochs": 2,
        "lr": LR,
        "schedule": "constant",
        "warmup_steps": 0,
        **settings,
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon_zero")
    inputs = make_inputs(root / "inputs", num_samples=40, min_len=24, max_len=96)
    single = root / "single"
    train = _train({"gradient_accumulation_steps": 2, "max_grad_norm": NEVER_REACHED})
    result = run_cli(["--config", str(write_config(inputs, single, train=train))])
    assert result.returncode == 0, result.stderr[-3000:]
    return inputs, root


def _records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "train"]


@pytest.fixture(scope="module")
def clipped(setup):
    """The single process with the clip active (torch's clip_grad_norm_, then torch's Muon)."""
    inputs, root = setup
    single = root / "single_clipped"
    train = _train({"gradient_accumulation_steps": 2, "max_grad_norm": CLIP})
    result = run_cli(["--config", str(write_config(inputs, single, train=train))])
    assert result.returncode == 0, result.stderr[-3000:]
    norms = [r["grad_norm"] for r in _records(single)]
    assert sum(n > CLIP for n in norms) >= STEPS // 2, norms  # the clip really acts
    return single


def _launch(
    inputs,
    run: Path,
    max_steps: int = STEPS,
    script: Path | None = None,
    max_grad_norm: float = 0,
) -> None:
    train = _train({"max_steps": max_steps, "max_grad_norm": max_grad_norm})
    config = write_config(inputs, run, train=train)
    env = env_for_subprocess()
    env["DS_ACCELERATOR"] = "cpu"
    program = [str(script)] if script else ["-m", "eagle3_train"]
    cmd = [ACCELERATE, "launch", "--config_file", "recipes/accelerate/zero2.yaml", *program]
    cmd += ["--config", str(config)]
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stderr[-4000:]}"


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "draft" / "model.safetensors"))


def _tolerances(single: Path, reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each Muon matrix's tolerance (module docstring), from the single run's momentum buffers."""
    from deepspeed.runtime.zero.muon.original_muon import zeropower_via_newtonschulz5
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

    ns = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    delta: dict[tuple[int, ...], float] = {}
    for step in (3, 6):
        saved = torch.load(single / "checkpoints" / f"step-{step:08d}" / "optimizer.bin")
        for i in saved["param_groups"][0]["params"]:  # MuonWithAdamW: Muon's group first
            m = saved["state"][i]["momentum_buffer"]
            ours = torch_ns(m, ns, 5, EPS).float()
            d = float((ours - zeropower_via_newtonschulz5(m, steps=5).float()).norm())
            # Rounding, not another iteration: no further from torch's than torch's own is from
            # itself on the same matrix rescaled (a no-op but for bf16 rounding; measured at
            # most 2.2x on these buffers)
            itself = max(
                float((ours - torch_ns(m * s, ns, 5, EPS).float()).norm()) for s in RESCALE
            )
            assert 0 < d <= 3 * itself, (tuple(m.shape), d, itself)
            delta[tuple(m.shape)] = max(delta.get(tuple(m.shape), 0.0), d)
    return {
        name: 2 * STEPS * LR * 0.2 * math.sqrt(max(w.shape)) * delta[tuple(w.shape)]
        for name, w in reference.items()
        if w.dim() == 2 and min(w.shape) > 1 and not any(v in name for v in VOCABULARY_ROWS)
    }


def _beyond(ours: dict[str, torch.Tensor], single: Path) -> tuple[list[str], list[str]]:
    """(every weight with its difference and tolerance, those beyond their tolerance)."""
    reference = _weights(single)
    tolerances = _tolerances(single, reference)
    largest = max(tolerances.values())
    report, beyond = [], []
    for name, w in reference.items():
        if not w.is_floating_point():
            continue
        diff = float((ours[name] - w).norm())
        tol = tolerances.get(name, largest)
        report.append(f"{name}: {diff:.3g} (tolerance {tol:.3g})")
        if diff > tol:
            beyond.append(report[-1])
    return report, beyond


def _assert_steps_as_torch(run: Path, single: Path) -> None:
    report, beyond = _beyond(_weights(run), single)
    print(f"{run.name} vs torch Muon, ||difference||_F after {STEPS} steps:", *report, sep="\n  ")
    assert not beyond, f"{run.name}: Muon differs from torch's beyond tolerance: {beyond}"


def test_zero2_muon_steps_as_torch_muon_in_one_process(setup):
    inputs, root = setup
    run, single = root / "zero2", root / "single"
    _launch(inputs, run)
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["world_size"] == 2
    # torch's side never clipped, so neither side clipped
    assert max(r["grad_norm"] for r in _records(single)) < NEVER_REACHED / 10
    # the same weights and data before the first step: the same first loss
    first = [_records(r)[0]["loss"] for r in (run, single)]
    assert first[0] == pytest.approx(first[1], rel=1e-6)
    _assert_steps_as_torch(run, single)
    _assert_momentum_as_torch(run, single)


def test_zero2_muon_clips_before_newton_schulz_as_torch_muon_in_one_process(setup, clipped):
    """train.max_grad_norm under ZeRO-2 with Muon: the global norm over both ranks'
    partitions, the gradient clipped before Newton–Schulz, as the single process does."""
    inputs, root = setup
    run = root / "zero2_clipped"
    _launch(inputs, run, max_grad_norm=CLIP)
    ours, theirs = _records(run), _records(clipped)
    # the same weights and data before the first step: the same gradient norm reported
    # (the norm before the clip, not DeepSpeed's norm of the orthogonalised update)
    assert ours[0]["grad_norm"] == pytest.approx(theirs[0]["grad_norm"], rel=1e-5)
    _assert_steps_as_torch(run, clipped)
    _assert_momentum_as_torch(run, clipped)


def _momentum_pairs(run: Path, single: Path) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(matrix, ZeRO-2's momentum, the single process's) for every Muon matrix in a ZeRO-2
    rank's partition after STEPS steps. ZeRO-2 keeps one flat buffer per Muon group (one group
    per shape, in muon_split's order: build.make_deepspeed_muon) of the whole matrices in the
    rank's partition: rank 0's are the first of the group, rank 1's the last."""
    saved = torch.load(single / "checkpoints" / f"step-{STEPS:08d}" / "optimizer.bin")
    theirs = [saved["state"][i]["momentum_buffer"] for i in saved["param_groups"][0]["params"]]
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for m in theirs:
        by_shape.setdefault(tuple(m.shape), []).append(m)
    files = sorted((run / "checkpoints" / f"step-{STEPS:08d}").rglob("*optim_states.pt"))
    assert len(files) == 2, files
    pairs = []
    for rank, f in enumerate(files):
        ours = _momentum(torch.load(f, weights_only=False))
        assert len(ours) == len(by_shape), (f, len(ours), list(by_shape))
        for flat, (shape, matrices) in zip(ours, by_shape.items(), strict=True):
            chunks = flat.view(-1, *shape)
            first = 0 if rank == 0 else len(matrices) - len(chunks)
            for j, chunk in enumerate(chunks):
                pairs.append((f"{shape}#{first + j}", chunk, matrices[first + j]))
    return pairs


def _momentum_differences(run: Path, single: Path) -> list[tuple[str, float]]:
    return [
        (name, float((ours.float() - theirs.float()).norm() / theirs.float().norm()))
        for name, ours, theirs in _momentum_pairs(run, single)
    ]


def _assert_momentum_as_torch(run: Path, single: Path) -> None:
    report, beyond = [], []
    for name, rel in _momentum_differences(run, single):
        report.append(f"{name}: {rel:.4f}")
        if rel > MOMENTUM_BOUND:
            beyond.append(report[-1])
    print(f"{run.name} vs torch Muon, momentum relative difference:", *report, sep="\n  ")
    assert not beyond, f"{run.name}: Muon momentum differs beyond {MOMENTUM_BOUND}: {beyond}"


def _planted(tmp_path: Path, install: str) -> Path:
    """A trainer whose zero_clip.install is replaced by ``install`` (a lambda's source)."""
    script = tmp_path / "planted.py"
    script.write_text(
        "import sys\n"
        "from eagle3_train.components import zero_clip\n"
        f"zero_clip.install = {install}\n"
        "from eagle3_train.cli import main\n"
        "sys.exit(main())\n"
    )
    return script


def test_zero2_muon_without_the_clip_is_caught(setup, clipped, tmp_path):
    """Negative control: the clip left out under ZeRO-2 (train.max_grad_norm set, nothing
    installed): the comparison with the clipped single process fails."""
    inputs, root = setup
    run = root / "zero2_unclipped_control"
    _launch(
        inputs,
        run,
        script=_planted(tmp_path, "lambda zero, max_norm: None"),
        max_grad_norm=CLIP,
    )
    with pytest.raises(AssertionError) as failure:
        _assert_momentum_as_torch(run, clipped)
    print(failure.value)
    assert all(rel > MOMENTUM_BOUND for _, rel in _momentum_differences(run, clipped))


def test_keller_scale_left_in_place_is_caught(setup, tmp_path):
    """Planted bug: DeepSpeed's Keller scale kept (the lr ratio to torch's match_rms_adamw
    dropped): the same comparison fails, naming the matrices whose scale differs most."""
    inputs, root = setup
    script = tmp_path / "keller_only.py"
    script.write_text(
        "import sys\n"
        "import eagle3_train.components.build as build\n"
        "build.deepspeed_muon_lr_ratio = lambda adjust_lr_fn, rows, cols: 1.0\n"
        "from eagle3_train.cli import main\n"
        "sys.exit(main())\n"
    )
    run = root / "keller_only"
    _launch(inputs, run, script=script)
    with pytest.raises(AssertionError) as failure:
        _assert_steps_as_torch(run, root / "single")
    print(failure.value)
    assert "fc.weight" in str(failure.value) and "mlp.gate_proj" in str(failure.value)


def test_a_resumed_zero2_muon_run_continues_exactly(setup):
    """3 steps, stop, resume to 6 under ZeRO-2: the same losses, weights and Muon momentum
    (each rank's flat partition of it) as 6 steps straight."""
    inputs, root = setup
    straight, resumed = root / "zero2", root / "zero2_resumed"
    if not (straight / "draft").exists():
        _launch(inputs, straight)
    _launch(inputs, resumed, max_steps=3)
    _launch(inputs, resumed)
    a, b = _records(straight), _records(resumed)
    assert [r["loss"] for r in b if r["step"] > 3] == [r["loss"] for r in a if r["step"] > 3]
    wa, wb = _weights(straight), _weights(resumed)
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    momentum = {}
    for run in (straight, resumed):
        files = sorted((run / "checkpoints" / "step-00000006").rglob("*optim_states.pt"))
        assert len(files) == 2, files  # one partition per rank
        momentum[run] = [_momentum(torch.load(f, weights_only=False)) for f in files]
    for mine, theirs in zip(momentum[straight], momentum[resumed], strict=True):
        assert mine and len(mine) == len(theirs)
        assert all(torch.equal(x, y) for x, y in zip(mine, theirs, strict=True))
        assert all(float(x.abs().max()) > 0 for x in mine)  # Muon really stepped


def _momentum(saved: dict) -> list[torch.Tensor]:
    state = saved["optimizer_state_dict"]["base_optimizer_state"]["state"]
    return [s["momentum_buffer"] for _, s in sorted(state.items()) if "momentum_buffer" in s]
