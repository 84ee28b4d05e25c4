"""train.optimizer: muon under DDP computes each matrix's Newton–Schulz once across the ranks
(components/sharded_muon.py), and its step is torch.optim.Muon's, bit for bit; on a CPU it
iterates in float32 (train.muon.newton_schulz_dtype: auto), nearer the exact orthogonalisation than
torch's bf16.

Two gloo processes step ShardedMuon over a fixed problem (support.muon_ranks); this process steps
torch.optim.Muon over the same. Every rank's matrices and momentum buffers equal torch's exactly,
and FlopCounterMode counts the ranks' Newton–Schulz FLOPs: together they are torch's one
process's, and no rank does more than 60 % of them (torch's Muon on each rank, the change
reverted, does all of them on every rank and fails here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3_train.components.build import make_muon
from eagle3_train.components.sharded_muon import ShardedMuon, newton_schulz, owners
from eagle3_train.config.run_config import Config
from eagle3_train.model.draft import Eagle3Draft

from support.muon_ranks import SHAPES, run
from support.train import REPO, yarn_arch

WORLD = 2


def test_the_plan_gives_each_matrix_one_owner_largest_first_to_the_least_loaded() -> None:
    shapes = [torch.Size(s) for s in [(8, 8), (64, 64), (32, 64), (64, 32), (4, 4)]]
    assert owners(shapes, 1) == [0] * 5
    # By cost (rows·cols·min side): the 64x64 alone outweighs the rest, which all go to rank 1.
    plan = owners(shapes, 2)
    assert plan == owners(list(shapes), 2)  # the same plan in every process
    assert plan == [1, 0, 1, 1, 1]
    assert set(owners(shapes, 8)) == {0, 1, 2, 3, 4}


def test_one_process_steps_as_torch_muon() -> None:
    ours, torch_muon = run(ShardedMuon), run(torch.optim.Muon)
    for key in ("params", "momentum"):
        for a, b in zip(ours[key], torch_muon[key], strict=True):
            assert torch.equal(a, b), key
    assert ours["flops"] == torch_muon["flops"]


def test_a_cpu_run_iterates_in_float32_nearer_the_exact_orthogonalisation_unless_told() -> None:
    config = Config()
    config.train.optimizer = "muon"
    model = Eagle3Draft(yarn_arch())
    assert make_muon(model, config, cuda=False).muon.newton_schulz_dtype == torch.float32
    assert make_muon(model, config, cuda=True).muon.newton_schulz_dtype == torch.bfloat16
    # chosen: a CPU run iterating as a GPU run does (and as speculators' CPU loop), and back
    for chosen, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        config.train.muon.newton_schulz_dtype = chosen
        for cuda in (False, True):
            assert make_muon(model, config, cuda=cuda).muon.newton_schulz_dtype == dtype
    coefficients = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's defaults
    generator = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        update = torch.randn(shape, generator=generator)
        kept = update.clone()
        exact, fp32, bf16 = (
            newton_schulz(update.double(), coefficients, 5, 1e-7, dtype).double()
            for dtype in (torch.float64, torch.float32, torch.bfloat16)
        )
        assert torch.equal(update, kept)  # the momentum buffer is not iterated in place
        fp32_off, bf16_off = float((fp32 - exact).norm()), float((bf16 - exact).norm())
        assert fp32_off < 1e-4 * float(exact.norm()) < bf16_off, (shape, fp32_off, bf16_off)


@pytest.mark.distributed
def test_two_ranks_step_as_torch_muon_and_share_the_newton_schulz_work(tmp_path: Path) -> None:
    path = os.pathsep.join(p for p in (str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    env["OMP_NUM_THREADS"] = "1"
    init = tmp_path / "init"
    outs = [tmp_path / f"rank{r}.pt" for r in range(WORLD)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "support.muon_ranks", str(r), str(WORLD), str(init), str(out)],
            env=env,
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r, out in enumerate(outs)
    ]
    for rank in ranks:
        _, stderr = rank.communicate(timeout=120)
        assert rank.returncode == 0, stderr[-3000:]
    reference = run(torch.optim.Muon)
    results = [torch.load(out) for out in outs]
    for result in results:
        for key in ("params", "momentum"):
            for i, (a, b) in enumerate(zip(result[key], reference[key], strict=True)):
                assert torch.equal(a, b), (key, SHAPES[i])
    for step, total in enumerate(reference["flops"]):
        per_rank = [result["flops"][step] for result in results]
        assert sum(per_rank) == total, (per_rank, total)
        assert max(per_rank) <= 0.6 * total, (per_rank, total)
