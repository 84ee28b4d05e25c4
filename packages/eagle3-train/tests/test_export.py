"""Export: the written directory validates clean with eagle3-schemas, and speculators' own
loader (Eagle3DraftModel.from_pretrained) reads it back with our weights."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from eagle3_schemas.draft_layout import VLLM_MLA, DraftLayoutError, detect_layout
from eagle3_schemas.validate import validate
from eagle3_train.components.build import build_model
from eagle3_train.config.run_config import load_config
from eagle3_train.data.inputs import checkpoint_lineage, load_inputs, resolve_arch
from eagle3_train.export.write import draft_config, export_weights, write_checkpoint
from eagle3_train.model.layers import Rotary

from support.train import YARN, write_config, write_target_model, yarn_arch


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
    _, model, run = exported
    lineage = {**checkpoint_lineage(run), "vocab_map_fingerprint": "sha256:" + "0" * 64}
    weights = export_weights(model.state_dict(), run.vocab.d2t, run.vocab.t2d, "float32")
    with pytest.raises(ValueError, match="does not match the d2t/t2d"):
        write_checkpoint(tmp_path / "bad", {}, weights, lineage, run.aux_layer_ids, {})
    assert not (tmp_path / "bad").exists()


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
