"""Export: the written directory validates clean with eagle3-schemas, and speculators' own
loader (Eagle3DraftModel.from_pretrained) reads it back with our weights."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from eagle3_schemas.contract.validate import validate
from eagle3_schemas.layouts.draft_layout import VLLM_MLA, DraftLayoutError, detect_layout
from eagle3_train.components.build import build_model
from eagle3_train.config.run_config import load_config
from eagle3_train.data.inputs import checkpoint_lineage, load_inputs, resolve_arch
from eagle3_train.export.write import draft_config, export_weights, write_checkpoint
from eagle3_train.model.layers import Rotary

from support.train import YARN, make_inputs, write_config, write_target_model, yarn_arch


def safetensors_names(path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


@pytest.fixture
def exported(inputs, tmp_path):
    config = load_config(write_config(inputs, tmp_path / "run"))
    run = load_inputs(config)
    arch = resolve_arch(run)
    model = build_model(run, arch, seed=0)
    with torch.no_grad():  # a non-trivial state, so a loader that reads nothing would be caught
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    # speculators' loader reads the verifier's weights: name a target that has them
    verifier = write_target_model(tmp_path / "verifier", hidden=16, v_target=64)
    cfg = draft_config(arch, run.aux_layer_ids, str(verifier), ["LlamaForCausalLM"], 3)
    weights = export_weights(model.state_dict(), run.vocab.d2t, run.vocab.t2d, "float32")
    out = write_checkpoint(
        tmp_path / "draft", cfg, weights, checkpoint_lineage(run), run.aux_layer_ids, {"steps": 0}
    )
    return out, model, run


def test_export_validates_clean(exported):
    out, _, run = exported
    assert validate(out) == []
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == run.aux_layer_ids
    assert cfg["draft_vocab_size"] == 24 and cfg["transformer_layer_config"]["vocab_size"] == 64
    assert cfg["speculators_config"]["verifier"]["name_or_path"].endswith("verifier")


def test_speculators_loader_reads_our_weights(exported):
    import speculators  # the dev group's: a missing one fails, it does not skip
    from speculators.models.eagle3 import Eagle3DraftModel

    out, model, run = exported
    with warnings.catch_warnings():
        # transformers/speculators warn about keys they fill later (verifier weights)
        warnings.simplefilter("ignore")
        loaded = Eagle3DraftModel.from_pretrained(str(out))
    assert isinstance(loaded, Eagle3DraftModel), speculators.__version__
    theirs = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(theirs[name], tensor, rtol=0, atol=0, msg=name)
    np.testing.assert_array_equal(theirs["d2t"].numpy(), run.vocab.d2t)
    np.testing.assert_array_equal(theirs["t2d"].numpy(), run.vocab.t2d)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == run.aux_layer_ids


def test_export_refuses_a_lineage_that_does_not_match_its_vocab(exported, tmp_path):
    out, model, run = exported
    config = json.loads((out / "config.json").read_text())
    lineage = {**checkpoint_lineage(run), "vocab_map_fingerprint": "sha256:" + "0" * 64}
    weights = export_weights(model.state_dict(), run.vocab.d2t, run.vocab.t2d, "float32")
    with pytest.raises(ValueError, match="does not match the vocabulary map"):
        write_checkpoint(tmp_path / "bad", config, weights, lineage, run.aux_layer_ids, {})
    assert not (tmp_path / "bad").exists()


def _export(run, arch, model, out):
    cfg = draft_config(arch, run.aux_layer_ids, None, ["LlamaForCausalLM"], 3)
    weights = export_weights(model.state_dict(), run.vocab.d2t, run.vocab.t2d, "float32")
    lineage = checkpoint_lineage(run)
    return cfg, weights, lineage


@pytest.fixture
def full_vocabulary(tmp_path):
    """A run whose draft vocabulary is the target's whole vocabulary (64 of 64)."""
    inputs = make_inputs(tmp_path / "inputs-full", v_draft=64)
    run = load_inputs(load_config(write_config(inputs, tmp_path / "run-full")))
    arch = resolve_arch(run)
    return run, arch, build_model(run, arch, seed=0)


def test_a_full_vocabulary_export_stores_no_vocabulary_map(full_vocabulary, tmp_path):
    """vLLM creates draft_id_to_target_id only when draft_vocab_size differs from the target's
    vocab_size and refuses a d2t it has no parameter for: a full-vocabulary export stores no
    d2t (nor t2d), validates as draft_checkpoint v3, and its lineage names the data stage's map
    (the identity), which the checks recompute without the tensors."""
    run, arch, model = full_vocabulary
    assert run.vocab.draft_vocab_size == arch.target_vocab_size == 64
    cfg, weights, lineage = _export(run, arch, model, tmp_path / "draft")
    assert "d2t" not in weights and "t2d" not in weights
    out = write_checkpoint(tmp_path / "draft", cfg, weights, lineage, run.aux_layer_ids, {})
    assert validate(out) == []
    header = json.loads((out / "eagle3.json").read_text())
    assert header["schema_version"] == 3
    assert header["lineage"]["vocab_map_fingerprint"] == run.vocab.fingerprint
    stored = safetensors_names(out / "model.safetensors")
    assert "d2t" not in stored and "t2d" not in stored and "lm_head.weight" in stored


def test_the_export_refuses_a_d2t_that_vllm_would_not_load(full_vocabulary, tmp_path):
    run, arch, model = full_vocabulary
    cfg, weights, lineage = _export(run, arch, model, tmp_path / "draft")
    weights["d2t"] = torch.zeros(64, dtype=torch.int64)  # what the export wrote before
    with pytest.raises(ValueError, match=r"tensor d2t: vLLM's Eagle3LlamaForCausalLM"):
        write_checkpoint(tmp_path / "draft", cfg, weights, lineage, run.aux_layer_ids, {})
    assert not (tmp_path / "draft").exists()


def test_validation_names_a_vocabulary_map_vllm_would_misread(exported, full_vocabulary, tmp_path):
    """The v3 check on both sides of the rule: a full-vocabulary draft holding d2t (vLLM refuses
    to load it) and a pruned one without (vLLM maps draft id i onto target id i)."""
    from safetensors.torch import load_file, save_file

    run, arch, model = full_vocabulary
    cfg, weights, lineage = _export(run, arch, model, tmp_path / "full")
    full = write_checkpoint(tmp_path / "full", cfg, weights, lineage, run.aux_layer_ids, {})
    tensors = load_file(str(full / "model.safetensors"))
    save_file(
        {**tensors, "d2t": torch.zeros(64, dtype=torch.int64)}, str(full / "model.safetensors")
    )
    found = {(v.file.split("/")[-1], v.location) for v in validate(full)}
    assert ("model.safetensors", "tensor d2t") in found, found

    pruned, _, _ = exported
    tensors = load_file(str(pruned / "model.safetensors"))
    del tensors["d2t"]
    save_file(tensors, str(pruned / "model.safetensors"))
    problems = [v for v in validate(pruned) if v.location == "tensor d2t"]
    assert problems and "target id i" in problems[0].message, validate(pruned)


def test_yarn_target_export_writes_one_consistent_rope_block():
    """The exported RoPE block names one type (the one the draft trained with) everywhere, and
    transformers' reader builds the draft's own rotary table from it."""
    from transformers import DeepseekV2Config, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    arch = yarn_arch()
    layer = draft_config(arch, [1, 2, 3], None, ["DeepseekV3ForCausalLM"], 3)[
        "transformer_layer_config"
    ]
    mla = draft_config(yarn_arch("mla"), [1, 2, 3], None, ["DeepseekV3ForCausalLM"], 3)
    for block in (layer, mla):
        for key in ("rope_parameters", "rope_scaling"):
            # no legacy "type" beside "rope_type": vLLM's patch_legacy_rope_type refuses a
            # conflict, and the pre-fix export wrote {"rope_type": "default", "type": "yarn"}
            assert "type" not in block[key], (key, block[key])
            assert block[key]["rope_type"] == "yarn", (key, block[key])
            assert block[key]["factor"] == YARN["factor"]
        assert block["rope_parameters"]["rope_theta"] == block["rope_theta"] == 50000.0

    read = LlamaConfig(**layer)
    assert read.rope_parameters["rope_type"] == "yarn"
    theirs = LlamaRotaryEmbedding(read)
    ours = Rotary(arch)
    assert theirs.attention_scaling == pytest.approx(ours.attention_scaling, rel=1e-12)
    torch.testing.assert_close(theirs.inv_freq, ours.inv_freq, rtol=0, atol=0)
    assert DeepseekV2Config(**mla).rope_parameters["rope_type"] == "yarn"


def test_mla_config_states_aux_ids_in_each_servers_counting():
    """The MLA draft's config.json is read by vLLM and SGLang (one class name): vLLM's target
    captures before layer id, from the top-level ids; SGLang's captures before layer id + 1,
    from eagle_config's ids only (its model_runner; set_eagle3_layers_to_capture adds 1). The
    pre-fix export copied the vLLM ids under eagle_config, so SGLang fed layers one off."""
    config = draft_config(yarn_arch("mla"), [2, 30, 58], None, ["DeepseekV3ForCausalLM"], 3)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 30, 58]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}
    sglang_captures = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert sglang_captures == config["eagle_aux_hidden_state_layer_ids"]
    layout = detect_layout(config)
    assert (layout.name, layout.aux_layer_ids, layout.note) == (VLLM_MLA, [2, 30, 58], "")
    # vLLM's id 0 (the embedding output) has no SGLang id: refused, not written one off.
    with pytest.raises(DraftLayoutError, match=r"include 0.*SGLang"):
        draft_config(yarn_arch("mla"), [0, 30, 58], None, ["DeepseekV3ForCausalLM"], 3)


def test_plain_rope_export_keeps_rope_scaling_null():
    arch = yarn_arch()
    arch.rope_scaling = None
    block = draft_config(arch, [1, 2, 3], None, ["LlamaForCausalLM"], 3)["transformer_layer_config"]
    assert block["rope_scaling"] is None
    assert block["rope_parameters"] == {"rope_type": "default", "rope_theta": 50000.0}
