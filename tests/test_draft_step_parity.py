"""The trainer's TTT step-k logits equal eagle3-eval's vLLM-semantics draft on the EXPORT.

Two implementations that share no code (issue 14, item 1):

- eagle3-train's training forward (``Eagle3Draft.forward``: packed documents, TTT unroll with
  the diagonal KV of earlier steps), run on the weights of its own resumable checkpoint;
- eagle3-eval's ``draft.chain_logits`` — written from vLLM 0.32's ``llama_eagle3.py`` and
  ``EagleProposer`` — run per document on the checkpoint that the trainer EXPORTED through
  its own CLI (``exports/step-N``: config.json + model.safetensors, speculators format).

A short real training run produces both (weights well away from init, the draft lm_head
trained too), for each flag the exported config.json carries and vLLM reads:
``norm_before_residual``, ``norm_before_fc``, EAGLE 3.1's ``fc_norm``, ``norm_output``,
``num_hidden_layers`` — and for the MLA draft (native Eagle3DeepseekV2 export; plain RoPE and Kimi's YaRN). The
packed batch holds three documents of different lengths, longer than the attention chunk.

Slot t of step k (trainer) is anchor t's chain step k (eval): fed the draft's step-(k-1)
output (step 0: ``fc(aux[t])``) and token x_{t+1+k} at position t+k, attending to the
step-0 keys of its document's rows 0..t and its own chain's keys of steps 1..k. Compared
wherever t+1+k lies inside the document (the slots the trainer scores or could score).

Tolerance. Both sides run float32 on the same stored (bf16) states and compute the same
real-number function; only the order of summations differs (chunked online softmax vs a
dense one, packed vs per-document matmuls, SDPA vs einsum). With unit roundoff
u = 2^-24 ≈ 6.0e-8, a float32 reduction of length n errs like a random walk, ~sqrt(n)·u
relative to its scale (Higham's probabilistic bound); the longest here are n = 96 (fc over
3 aux states of H = 32) and n = 64 (down_proj, attention over <= 60 keys). A 4-step chain
composes S ≈ 4 × 12 = 50 such stages (norms, q/k/v, rope, softmax, o_proj, the MLP's three,
the final norm, lm_head), each amplifying earlier error by L ≈ 1-3 (the stages are
normalised), so the expected error is ~ sqrt(S)·sqrt(96)·u·L ≈ 7.1 × 9.8 × 6e-8 × 3 ≈ 1.3e-5
of the logit scale (the worst case, S·n·u·L ≈ 9e-4, assumes every rounding aligned and is
never approached). We require, per step k,
``max |Δlogit| <= 2e-5 · max(1, max |logit|)`` over every in-document slot. Measured:
<= 3.0e-7 on every variant and step (~70× inside); the negative control (norm_before_residual
flipped in the exported config.json) gives 0.50-0.65, 25,000× the tolerance.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_eval.draft import Eagle3Draft as EvalDraft
from eagle3_eval.draft import chain_logits
from eagle3_eval.offline import read_samples
from eagle3_train.components.build import build_model
from eagle3_train.config.run_config import load_config
from eagle3_train.data.inputs import load_inputs, resolve_arch
from eagle3_train.data.loader import ShardReader
from eagle3_train.model.layers import RMSNorm

from support.drafts import YARN
from support.synthetic_states import llama_target, synthetic_lineage, write_samples
from support.train import (
    Inputs,
    train_in_process,
    write_config,
    write_target_config,
    write_vocab_map,
)

STEPS = 4  # k = 0..3
HIDDEN, V_TARGET, V_DRAFT = 32, 96, 40
REL_TOL = 2e-5

MLA = {
    "architecture": "mla",
    "num_attention_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 24,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 16,
    "v_head_dim": 12,
}
VARIANTS = {
    "plain": {},
    "norm_before_residual": {"norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    # EAGLE 3.1's per-aux norms (the aux states here differ in scale by layer, so they work)
    "fc_norm": {"fc_norm": True},
    "fc_norm_norm_output_2_layers": {"fc_norm": True, "norm_output": True, "num_layers": 2},
    "all_flags_2_layers_sdpa": {
        "norm_before_residual": True,
        "norm_before_fc": True,
        "norm_output": True,
        "num_layers": 2,
        "attention": "sdpa",
    },
    # The MLA draft (vLLM's Eagle3DeepseekV2ForCausalLM, native export): small latent sizes
    # (the 576 that vLLM's kernels take is a preflight rule, off in these runs).
    "mla": MLA,
    "mla_fc_norm_norm_output": {**MLA, "fc_norm": True, "norm_output": True},
    "mla_yarn_norm_before_residual_sdpa": {
        **MLA,
        "norm_before_residual": True,
        "attention": "sdpa",
        "rope_scaling": YARN,
    },
}


def realistic_inputs(root: Path) -> Inputs:
    """A bf16 hidden-state dataset whose states look like a real residual stream: magnitudes
    growing with depth (aux ids 1, 2, 3 of a 4-layer target) and two outlier channels, so the
    norms (hidden_norm, norm_before_fc's input_norm, the final norm) do real work."""
    gen = torch.Generator().manual_seed(7)
    embed = torch.randn(V_TARGET, HIDDEN, generator=gen)
    mix = torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN**0.5
    outliers = torch.zeros(HIDDEN)
    outliers[3], outliers[11] = 40.0, -25.0
    samples = []
    for n in (23, 57, 38, 31, 49, 44, 27, 60):  # different lengths
        x = torch.randint(0, V_TARGET, (n,), generator=gen)
        follow = torch.rand(n, generator=gen) < 0.7  # mostly id + 1: learnable
        for t in range(1, n):
            if follow[t]:
                x[t] = (x[t - 1] + 1) % V_TARGET
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[n // 3 :] = 1
        base = embed[x] @ mix
        aux = torch.stack(
            [
                (2.0 + 3.0 * layer) * base
                + (0.5 + layer) * torch.randn(n, HIDDEN, generator=gen)
                + layer * outliers
                for layer in (1, 2, 3)
            ],
            dim=1,
        )
        last = 14.0 * base + 4.0 * outliers + torch.randn(n, HIDDEN, generator=gen)
        samples.append((x, mask, aux, last))
    label = "parity"
    lineage = synthetic_lineage(label)
    target = llama_target(HIDDEN, 4, V_TARGET, rms_norm_eps=1e-5)
    head = {
        "norm.weight": 1.0 + 0.1 * torch.randn(HIDDEN, generator=gen),
        "lm_head.weight": torch.randn(V_TARGET, HIDDEN, generator=gen),
        "embed_tokens.weight": embed,
    }
    hs = write_samples(
        root / "hidden_states", samples, head, target, lineage, [1, 2, 3], "bfloat16", 5, label
    )
    vm = write_vocab_map(root / "vocab_map.safetensors", V_TARGET, V_DRAFT, label=label)
    tgt = write_target_config(
        root / "target",
        hidden=HIDDEN,
        v_target=V_TARGET,
        heads=4,
        kv_heads=2,
        intermediate=64,
        rms_norm_eps=1e-5,
    )
    return Inputs(root, hs, vm, tgt)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return realistic_inputs(tmp_path_factory.mktemp("parity"))


@pytest.fixture(scope="module")
def runs(inputs, tmp_path_factory: pytest.TempPathFactory):
    """name -> output directory of a short real run through the trainer's CLI (made once)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = train_variant(name, inputs, tmp_path_factory.mktemp(name) / "run")
        return done[name]

    return get


def train_variant(name: str, inputs, out: Path) -> Path:
    config = write_config(
        inputs,
        out,
        draft={
            "aux_layer_ids": [1, 2, 3],
            "attention_chunk": 32,
            "train_lm_head": True,
            **VARIANTS[name],
        },
        train={
            "max_steps": 6,
            "lr": 2e-2,
            "warmup_steps": 0,
            "schedule": "constant",
            "ttt_steps": STEPS,
            "log_every": 6,
            "save_every": 0,
            "trackers": [],
            "torch_threads": 1,
            "progress_bar": False,
            "preflight": False,
            "validate_inputs": False,
        },
        data={"validation_fraction": 0.0, "max_tokens_per_batch": 96},
        export={"dtype": "float32"},
    )
    assert train_in_process(["--config", str(config)]) == 0
    return out


def _latest(root: Path) -> Path:
    found = sorted(p for p in root.glob("step-*") if p.is_dir())
    assert found, f"nothing under {root}"
    return found[-1]


def trainer_step_logits(run: Path, doc_ids: list[int]):
    """The training forward's per-step draft logits on a packed batch of ``doc_ids``.

    The weights come from the run's last resumable checkpoint (Accelerate's save_state),
    not from the export. The logits are formed from what the trainer's fused LM-head + KL
    reads at each step — the final norm of the step's state, of which it takes the scored
    rows — times the draft lm_head, for every row.
    """
    config = load_config(run / "run.yaml")
    inputs = load_inputs(config)
    arch = resolve_arch(inputs)
    model = build_model(inputs, arch, seed=0)
    state = load_file(str(_latest(run / "checkpoints") / "model.safetensors"))
    model.load_state_dict(state, strict=True)
    model.eval()
    ds = inputs.dataset
    batch = ShardReader(ds).read([(i, int(ds.num_tokens[i])) for i in doc_ids])
    captured: list[torch.Tensor] = []
    # each step's state through the final norm (the fused LM head norms its rows in its loop)
    hook = model.norm.register_forward_hook(
        lambda m, args, _out: captured.append(RMSNorm.forward(m, args[0]))
    )
    with torch.no_grad():
        model(
            batch["aux_hidden_states"],
            batch["last_hidden_state"],
            batch["input_ids"],
            batch["loss_mask"],
            batch["cu_seqlens"],
            STEPS,
        )
    hook.remove()
    assert len(captured) == STEPS
    w = model.lm_head.weight.detach()
    return [h @ w.T for h in captured], batch["cu_seqlens"].tolist(), batch["sample_ids"]


def eval_step_logits(
    export: Path, dataset: Path, sample_ids: list[str]
) -> tuple[EvalDraft, dict[str, list[torch.Tensor]]]:
    """eagle3-eval's chain logits per document (one request each), on the exported checkpoint,
    with the target's embeddings from the dataset (the export carries none, as vLLM shares
    the target's)."""
    head = load_file(str(dataset / "target_head.safetensors"))
    draft = EvalDraft.load(export, head["embed_tokens.weight"])
    samples = {s.sample_id: s for s in read_samples(dataset, None)}
    with torch.no_grad():
        return draft, {
            sid: chain_logits(draft, samples[sid].aux, samples[sid].input_ids, STEPS)
            for sid in sample_ids
        }


def compare(train_logits, cu, sample_ids, eval_logits) -> list[float]:
    """Per step: max |Δ| / max(1, max |logit|) over the in-document slots of every document."""
    worst = []
    for k in range(STEPS):
        diff, scale = 0.0, 1.0
        for d, sid in enumerate(sample_ids):
            start, end = cu[d], cu[d + 1]
            n = end - start - 1 - k  # anchors t with t+1+k inside the document
            assert n > 0
            ours = train_logits[k][start : start + n]
            theirs = eval_logits[sid][k][:n]
            diff = max(diff, float((ours - theirs).abs().max()))
            scale = max(scale, float(theirs.abs().max()))
        worst.append(diff / scale)
    return worst


def _three_documents(run: Path) -> list[int]:
    """Three documents of different lengths (first, shortest, longest), packed in that order."""
    from eagle3_train.data.dataset import HiddenStateDataset

    ds = HiddenStateDataset(load_config(run / "run.yaml").data.hidden_states)
    lengths = [int(n) for n in ds.num_tokens]
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    picked = [order[len(order) // 2], order[0], order[-1]]
    assert len({lengths[i] for i in picked}) == 3
    return picked


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trainer_step_k_logits_match_eval_vllm_forward_on_the_export(runs, variant: str):
    run = runs(variant)
    export = _latest(run / "exports")
    config = json.loads((export / "config.json").read_text())
    draft_cfg = load_config(run / "run.yaml").draft
    # the flags under test really are in the served config
    assert config["norm_before_residual"] is draft_cfg.norm_before_residual
    assert config["norm_output"] is draft_cfg.norm_output
    assert config["fc_norm"] is draft_cfg.fc_norm
    if draft_cfg.architecture == "mla":  # vLLM's native Eagle3DeepseekV2 layout
        assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
        assert config["num_hidden_layers"] == draft_cfg.num_layers
    else:
        assert config["norm_before_fc"] is draft_cfg.norm_before_fc
        assert config["transformer_layer_config"]["num_hidden_layers"] == draft_cfg.num_layers
    # weights are well away from init (std-0.02 normals, norms at one)
    weights = load_file(str(export / "model.safetensors"))
    assert float((weights["layers.0.hidden_norm.weight"] - 1).abs().max()) > 0.05
    fc_norms = sorted(n for n in weights if n.startswith("fc_norm."))
    assert fc_norms == ([f"fc_norm.{i}.weight" for i in range(3)] if draft_cfg.fc_norm else [])
    for name in fc_norms:  # trained through the TTT unroll
        assert float((weights[name] - 1).abs().max()) > 0.05, name
    card = (export / "README.md").read_text()  # the model card states the norms it was given
    assert (
        f"EAGLE 3.1 norms: fc_norm {draft_cfg.fc_norm}, norm_before_fc "
        f"{draft_cfg.norm_before_fc}, norm_output {draft_cfg.norm_output}"
    ) in card

    docs = _three_documents(run)
    train_logits, cu, sample_ids = trainer_step_logits(run, docs)
    dataset = Path(load_config(run / "run.yaml").data.hidden_states)
    draft, eval_logits = eval_step_logits(export, dataset, sample_ids)
    # vLLM maps draft id i to target id i + d2t[i]: the export's d2t is the trainer's vocab map
    vocab = load_inputs(load_config(run / "run.yaml")).vocab
    assert draft.target_ids().tolist() == vocab.target_ids.tolist()
    worst = compare(train_logits, cu, sample_ids, eval_logits)
    assert all(w <= REL_TOL for w in worst), f"relative max |Δlogit| per step k=0..3: {worst}"


def _flip_norm_before_residual(config: dict, weights: dict) -> None:
    config["norm_before_residual"] = not config["norm_before_residual"]


def _ignore_fc_norm(config: dict, weights: dict) -> None:
    config["fc_norm"] = False
    for name in [n for n in weights if n.startswith("fc_norm.")]:
        del weights[name]


@pytest.mark.parametrize(
    ("run_name", "serving_mismatch"),
    [("plain", _flip_norm_before_residual), ("fc_norm", _ignore_fc_norm)],
    ids=["flipped_norm_before_residual", "ignored_fc_norm"],
)
def test_the_comparison_sees_a_serving_mismatch(runs, tmp_path: Path, run_name, serving_mismatch):
    """Negative controls: the same export read as a server that misreads it would (a flag
    flipped in config.json; fc_norm ignored, its weights dropped) disagrees at every step —
    the check has the power to see such a mismatch."""
    run = runs(run_name)
    export = _latest(run / "exports")
    config = json.loads((export / "config.json").read_text())
    weights = load_file(str(export / "model.safetensors"))
    serving_mismatch(config, weights)
    misread = tmp_path / "misread"
    shutil.copytree(export, misread)
    (misread / "config.json").write_text(json.dumps(config))
    save_file(weights, str(misread / "model.safetensors"))
    docs = _three_documents(run)
    train_logits, cu, sample_ids = trainer_step_logits(run, docs)
    dataset = Path(load_config(run / "run.yaml").data.hidden_states)
    _, eval_logits = eval_step_logits(misread, dataset, sample_ids)
    worst = compare(train_logits, cu, sample_ids, eval_logits)
    assert min(worst) > 100 * REL_TOL, worst
