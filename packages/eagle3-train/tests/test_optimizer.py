"""train.optimizer: muon — which tensors Muon takes, that a resumed run continues Muon's
state bit for bit, and that DeepSpeed's Muon is set up to step as torch's (the 2-process
ZeRO-2 runs are test_muon_zero.py; the DeepSpeed refusals test_preflight.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from accelerate.state import AcceleratorState
from safetensors.torch import load_file

from eagle3_train.components import build
from eagle3_train.components.accelerator import set_deepspeed_config
from eagle3_train.components.build import MuonWithAdamW, make_deepspeed_muon, make_muon, muon_split
from eagle3_train.config.run_config import Config
from eagle3_train.model.draft import Eagle3Draft

from support.train import make_inputs, write_config, yarn_arch


def test_muon_takes_the_hidden_matrices_and_adamw_the_norms_and_vocabulary_rows():
    model = Eagle3Draft(dataclasses.replace(yarn_arch(), num_layers=2, fc_norm=True))
    muon, adamw = muon_split(model)
    name = {id(p): n for n, p in model.named_parameters()}
    to_muon = sorted(name[id(p)] for p in muon)
    to_adamw = sorted(name[id(p)] for p in adamw)
    assert "fc.weight" in to_muon and "layers.1.mlp.down_proj.weight" in to_muon
    assert "layers.0.self_attn.q_proj.weight" in to_muon
    assert "lm_head.weight" in to_adamw and "fc_norm.2.weight" in to_adamw
    assert all(dict(model.named_parameters())[n].dim() == 2 for n in to_muon)
    assert all("norm" in n for n in to_adamw if n != "lm_head.weight")
    assert len(to_muon) + len(to_adamw) == len(list(model.parameters()))


def test_muon_defaults_are_speculators_and_the_schedule_reaches_both_groups():
    model = Eagle3Draft(yarn_arch())
    config = Config()
    config.train.optimizer = "muon"
    opt = make_muon(model, config, cuda=False)
    muon_group, adamw_group = opt.param_groups
    assert opt.muon.param_groups[0] is muon_group and opt.adamw.param_groups[0] is adamw_group
    assert (muon_group["momentum"], muon_group["weight_decay"], muon_group["ns_steps"]) == (
        0.95,
        0.1,
        5,
    )
    assert muon_group["adjust_lr_fn"] == "match_rms_adamw"
    assert adamw_group["weight_decay"] == 0.01
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    assert [g["lr"] for g in opt.muon.param_groups + opt.adamw.param_groups] == [
        0.5 * config.train.lr
    ] * 2
    del schedule


def _run(inputs, out, max_steps: int, main) -> None:
    config = write_config(
        inputs,
        out,
        train={
            "optimizer": "muon",
            "max_steps": max_steps,
            "save_every": 3,
            "keep_checkpoints": 3,
            "log_every": 1,
            "lr": 3e-3,
            "schedule": "constant",
            "warmup_steps": 0,
        },
    )
    try:
        assert main(["--config", str(config), "--no-preflight"]) == 0
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _train_losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r.get("event") == "train"}


def test_a_resumed_muon_run_continues_bit_for_bit(tmp_path, in_process):
    """6 steps straight vs 3 steps, stop, resume to 6: the same losses, weights and Muon
    momentum buffers (and AdamW moments), to the bit."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=24)
    _run(inputs, tmp_path / "straight", 6, in_process)
    _run(inputs, tmp_path / "resumed", 3, in_process)
    _run(inputs, tmp_path / "resumed", 6, in_process)
    straight, resumed = _train_losses(tmp_path / "straight"), _train_losses(tmp_path / "resumed")
    assert [resumed[k] for k in (4, 5, 6)] == [straight[k] for k in (4, 5, 6)]
    a, b = (tmp_path / run / "checkpoints" / "step-00000006" for run in ("straight", "resumed"))
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)
    sa = torch.load(a / "optimizer.bin", weights_only=True)["state"]
    sb = torch.load(b / "optimizer.bin", weights_only=True)["state"]
    buffers = [i for i in sa if "momentum_buffer" in sa[i]]
    assert buffers and all(
        torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]) for i in buffers
    )
    assert all(
        torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa if i not in buffers
    )
    # ... and the buffers are not a trivial zero: Muon really stepped
    assert all(float(sa[i]["momentum_buffer"].abs().max()) > 0 for i in buffers)


def test_the_combined_optimizer_state_dict_holds_both_and_loads_into_a_fresh_one():
    torch.manual_seed(0)
    model = Eagle3Draft(yarn_arch())
    config = Config()
    config.train.optimizer = "muon"
    opt = make_muon(model, config, cuda=False)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    fresh = make_muon(Eagle3Draft(yarn_arch()), config, cuda=False)
    fresh.load_state_dict(opt.state_dict())
    assert isinstance(fresh, MuonWithAdamW)
    # the inner optimizers see the loaded state (a stale copy would restart Muon's momentum)
    assert fresh.muon.state is fresh.state and fresh.adamw.state is fresh.state
    assert fresh.muon.param_groups[0] is fresh.param_groups[0]
    assert sum("momentum_buffer" in s for s in fresh.state.values()) == len(
        fresh.muon.param_groups[0]["params"]
    )


def _one_step(opt: torch.optim.Optimizer, model: Eagle3Draft, grads: dict[str, torch.Tensor]):
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.grad = grads[name].clone()
    opt.step()


@pytest.mark.process
def test_deepspeed_muon_steps_as_torch_muon_and_the_lr_ratio_is_what_makes_it(monkeypatch):
    """make_deepspeed_muon's groups (DeepSpeed's MuonWithAuxAdam; outside ZeRO it orthogonalises
    each whole matrix itself, the same muon_update ZeRO calls) against make_muon, one step on the
    same gradients: equal to Newton–Schulz's bf16 rounding (a few percent of the step at most),
    and with the lr ratio dropped (DeepSpeed's Keller scale left) off by the ratio itself.
    The 2-process ZeRO-2 run is tests/test_muon_zero.py."""
    pytest.importorskip("deepspeed")
    config = Config()
    config.train.optimizer, config.train.lr = "muon", 5e-3

    def step_of(make) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Eagle3Draft(yarn_arch())
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        generator = torch.Generator().manual_seed(1)
        grads = {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}
        opt = make(model)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)  # ours, ratio kept
        _one_step(opt, model, grads)
        del schedule
        return {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}

    torch_step = step_of(lambda m: make_muon(m, config, cuda=False))
    deepspeed_step = step_of(lambda m: make_deepspeed_muon(m, config, fused=False))
    monkeypatch.setattr(build, "deepspeed_muon_lr_ratio", lambda fn, rows, cols: 1.0)
    keller_step = step_of(lambda m: make_deepspeed_muon(m, config, fused=False))
    matrices = [n for n, s in torch_step.items() if s.dim() == 2 and "lm_head" not in n]
    assert matrices
    for name in matrices:
        size = float(torch_step[name].norm())
        off = float((deepspeed_step[name] - torch_step[name]).norm()) / size
        keller_off = float((keller_step[name] - torch_step[name]).norm()) / size
        rows, cols = torch_step[name].shape
        ratio = 0.2 * math.sqrt(max(rows, cols)) / math.sqrt(max(1, rows / cols))
        assert off < 0.1, (name, off)  # rounding
        assert keller_off == pytest.approx(abs(1 - 1 / ratio), abs=0.1), (name, keller_off)
    for name in set(torch_step) - set(matrices):  # AdamW's tensors: torch's AdamW both sides
        torch.testing.assert_close(deepspeed_step[name], torch_step[name], msg=name)


def test_max_grad_norm_0_is_no_clip(tmp_path, in_process):
    """train.max_grad_norm: 0 (no clip) trains as a clip never reached
    does, bit for bit; torch's clip_grad_norm_ with 0 would have zeroed every gradient."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=12)
    weights = {}
    for name, limit in (("off", 0), ("never", 1e9), ("tight", 1e-3)):
        train = {"optimizer": "muon", "max_steps": 2, "max_grad_norm": limit, "warmup_steps": 0}
        config = write_config(inputs, tmp_path / name, train=train)
        try:
            assert in_process(["--config", str(config), "--no-preflight"]) == 0
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
        weights[name] = load_file(str(tmp_path / name / "draft" / "model.safetensors"))
    assert all(torch.equal(weights["off"][n], weights["never"][n]) for n in weights["off"])
    # ... and the clip is really applied when set: a tight one trains another draft
    assert not all(torch.equal(weights["off"][n], weights["tight"][n]) for n in weights["off"])


def test_under_zero2_muon_deepspeed_computes_no_gradient_norm_nothing_reads():
    pytest.importorskip("deepspeed")
    for optimizer in ("muon", "adamw"):
        config = Config()
        config.train.optimizer = optimizer
        ds: dict = {"zero_optimization": {"stage": 2}}
        set_deepspeed_config(ds, config.train)
        muon = optimizer == "muon"
        assert ds["gradient_clipping"] == (0.0 if muon else config.train.max_grad_norm)
        assert ds["zero_optimization"].get("compute_grad_norm", True) is not muon
