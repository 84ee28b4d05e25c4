"""export.format sglang / both, and draft.init_from from the SpecForge / SGLang layout.

The SGLang folder is held to SGLang's source, not to our own rule: it must equal the hand-made
SpecForge layout of the speculators export (tests/support/sglang_layout.py: aux ids vLLM - 1
under eagle_config, layer 0 as midlayer.*), and every tensor must be one SGLang's load_weights
maps. Read back by draft.init_from, it starts a run with the same weights (the same
validation loss as the run that wrote it) and the lineage records the layout.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from eagle3_schemas.layouts.draft_layout import sglang_loads
from eagle3_train.export.init_from import read_init_draft

from support.sglang_layout import sglang_copy
from support.train import make_inputs, validation_losses, write_config

DRAFT = {"norm_before_residual": False, "attention_chunk": 64}


def test_both_layouts_are_published_and_the_sglang_one_starts_a_run(
    tmp_path, in_process, caplog
) -> None:
    inputs = make_inputs(tmp_path / "inputs", num_samples=40)
    config_a = write_config(
        inputs,
        tmp_path / "a",
        draft=DRAFT,
        train={"max_steps": 4, "save_every": 0, "warmup_steps": 1},
        data={"validation_fraction": 0.2},
        export={"format": "both", "dtype": "float32"},
    )
    assert in_process(["--config", str(config_a)]) == 0
    ours, sglang = tmp_path / "a" / "draft", tmp_path / "a" / "draft-sglang"
    by_hand = sglang_copy(ours, tmp_path / "by-hand")

    config = json.loads((sglang / "config.json").read_text())
    expected = json.loads((by_hand / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert {k: config.get(k) for k in expected} == expected
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's, for vllm serve
    written, hand = (
        load_file(str(sglang / "model.safetensors")),
        load_file(str(by_hand / "model.safetensors")),
    )
    assert sorted(written) == sorted(hand)
    for name, tensor in written.items():
        assert torch.equal(tensor, hand[name]), name
        assert name == "t2d" or sglang_loads(name) is not None, f"SGLang would skip {name}"
    card = (sglang / "README.md").read_text()
    assert "python -m sglang.launch_server" in card and "vllm serve" in card
    assert "--speculative-draft-model-path" in card

    # draft.init_from the SGLang folder: same weights, hence A's recorded validation loss.
    init = read_init_draft(sglang)
    assert (init.layout, init.aux_layer_ids) == ("sglang", [1, 2, 3])
    assert "[0, 1, 2] in SGLang" in init.layout_note
    recorded = json.loads((ours / "eagle3.json").read_text())["training"]["metrics"]["val/loss"]
    config_b = write_config(
        inputs,
        tmp_path / "b",
        draft={**DRAFT, "aux_layer_ids": [1, 2, 3], "init_from": str(sglang)},
        train={"max_steps": 1, "save_every": 0, "warmup_steps": 1},
        data={"validation_fraction": 0.2},
    )
    loaded, fresh = validation_losses(config_b)
    assert loaded == pytest.approx(recorded, rel=1e-5, abs=1e-6)
    assert fresh > loaded + 0.1
    with caplog.at_level(logging.INFO, logger="eagle3_train"):
        assert in_process(["--config", str(config_b)]) == 0
    assert "sglang layout" in caplog.text
    lineage = json.loads((tmp_path / "b" / "draft" / "eagle3.json").read_text())["lineage"]
    assert lineage["init_from_layout"] == "sglang"


def test_an_sglang_export_of_a_draft_sglang_cannot_serve_is_refused_before_any_step(
    tmp_path, in_process, caplog
) -> None:
    inputs = make_inputs(tmp_path / "inputs", num_samples=16)
    config = write_config(
        inputs,
        tmp_path / "c",
        draft={"norm_before_residual": True, "attention_chunk": 64},
        export={"format": "sglang"},
    )
    with caplog.at_level(logging.ERROR, logger="eagle3_train"):
        assert in_process(["--config", str(config)]) == 2
    assert "export.format sglang: draft.norm_before_residual true" in caplog.text
    assert "train with draft.norm_before_residual: false" in caplog.text
    assert not (tmp_path / "c" / "checkpoints").exists()


def test_a_mixed_sglang_weight_file_is_refused_with_nothing_loaded(tmp_path) -> None:
    from safetensors.torch import save_file

    from eagle3_train.export.init_from import InitFromError

    directory = tmp_path / "mixed"
    directory.mkdir()
    (directory / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLMEagle3"],
                "hidden_size": 8,
                "vocab_size": 32,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
            }
        )
    )
    save_file(
        {"layers.0.mlp.up_proj.weight": torch.zeros(2, 2), "d2t": torch.zeros(3).long()},
        str(directory / "model.safetensors"),
    )
    with pytest.raises(InitFromError, match="mix layouts"):
        read_init_draft(directory)
