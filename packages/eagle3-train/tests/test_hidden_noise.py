"""train.hidden_noise: Gaussian noise on the auxiliary hidden states of training micro-batches,
scaled to each token's RMS in its layer, and never on validation's."""

from __future__ import annotations

import json

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

from eagle3_train.config.run_config import ConfigError, load_config, parse_override
from eagle3_train.data.batch import add_relative_noise, forward

from support.train import make_inputs, small_draft, write_config


def _config(tmp_path, noise: float):
    path = tmp_path / "c.yaml"
    path.write_text("data: {hidden_states: h, vocab_map: v.safetensors}\n")
    return load_config(path, [parse_override(f"train.hidden_noise={noise}")])


def _draft_and_batch():
    model = small_draft(draft_vocab_size=3)
    g = torch.Generator().manual_seed(1)
    T = 90
    # layers of very different scales: the noise must follow each one's
    scales = torch.tensor([0.1, 1.0, 30.0]).view(1, 3, 1)
    batch = {
        "aux_hidden_states": torch.randn(T, 3, 16, generator=g) * scales,
        "last_hidden_state": torch.randn(T, 16, generator=g),
        "input_ids": torch.randint(0, 40, (T,), generator=g),
        "loss_mask": torch.rand(T, generator=g) < 0.8,
        "cu_seqlens": torch.tensor([0, 50, T], dtype=torch.int32),
    }
    return model, batch


@pytest.fixture
def accelerator():
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_noise_is_scaled_to_each_tokens_rms_in_its_layer():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(4000, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 50.0]).view(1, 3, 1)
    torch.manual_seed(0)
    noisy = add_relative_noise(hidden, 0.2)
    rms = hidden.pow(2).mean(-1).sqrt()  # (tokens, layers)
    ratio = (noisy - hidden).pow(2).mean(-1).sqrt() / rms
    assert ratio.mean(0).tolist() == pytest.approx([0.2, 0.2, 0.2], rel=0.02)
    torch.manual_seed(0)
    assert torch.equal(add_relative_noise(hidden, 0.2), noisy)  # drawn from the seeded RNG
    assert add_relative_noise(hidden.bfloat16(), 0.2).dtype == torch.bfloat16


def test_training_micro_batches_get_the_noise_and_validation_does_not(tmp_path, accelerator):
    model, batch = _draft_and_batch()
    clean = forward(model, batch, accelerator, _config(tmp_path, 0.0), training=True)[0]
    noisy_config = _config(tmp_path, 0.3)
    # validation (training=False) reads the states as they are, noise configured or not
    assert torch.equal(forward(model, batch, accelerator, noisy_config)[0], clean)
    torch.manual_seed(5)
    noisy = forward(model, batch, accelerator, noisy_config, training=True)[0]
    assert not torch.isclose(noisy, clean, rtol=1e-3)
    torch.manual_seed(5)  # the same draw gives the same loss
    assert torch.equal(forward(model, batch, accelerator, noisy_config, training=True)[0], noisy)
    assert torch.equal(batch["aux_hidden_states"], _draft_and_batch()[1]["aux_hidden_states"])


def test_a_run_trains_on_noisy_states_from_its_first_step(tmp_path, in_process):
    inputs = make_inputs(tmp_path / "inputs", num_samples=24)
    first_loss = {}
    for noise in (0.0, 0.0, 0.5):  # the repeat: runs alike without noise (negative control)
        run = tmp_path / f"run-{noise}-{len(first_loss)}"
        config = write_config(inputs, run, train={"max_steps": 1, "save_every": 0})
        assert in_process(["--config", str(config), "--set", f"train.hidden_noise={noise}"]) == 0
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        first_loss[run.name] = next(r["loss"] for r in records if r.get("event") == "train")
    plain, repeat, noisy = first_loss.values()
    assert plain == repeat
    assert noisy != pytest.approx(plain, rel=1e-4)


def test_negative_noise_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.hidden_noise: -0\.1 must be >= 0"):
        _config(tmp_path, -0.1)
