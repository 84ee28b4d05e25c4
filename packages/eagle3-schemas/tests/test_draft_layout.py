"""The layout of a draft config and the aux-id rule between SGLang's counting and vLLM's."""

from __future__ import annotations

import pytest

from eagle3_schemas.layouts.draft_layout import (
    COUNTING,
    SGLANG,
    SPECULATORS,
    VLLM_MLA,
    DraftLayoutError,
    detect_layout,
    sglang_to_vllm_ids,
    sglang_to_vllm_names,
    vllm_to_sglang_ids,
)

# The example (sglang issue 18216): vLLM [2, 30, 58] is SGLang [1, 29, 57].
VLLM_IDS, SGLANG_IDS = [2, 30, 58], [1, 29, 57]


def sglang_config(**extra):
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "draft_vocab_size": 32000,
        "target_hidden_size": 7168,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_IDS},
        **extra,
    }


def test_the_rule_both_ways() -> None:
    assert sglang_to_vllm_ids(SGLANG_IDS) == VLLM_IDS
    assert vllm_to_sglang_ids(VLLM_IDS) == SGLANG_IDS
    with pytest.raises(DraftLayoutError, match=r"embedding output.*SGLang"):
        vllm_to_sglang_ids([0, 3, 5])


def test_each_layout_is_named_with_its_counting() -> None:
    layout = detect_layout(sglang_config())
    assert (layout.name, layout.aux_ids_as_written, layout.aux_layer_ids) == (
        SGLANG,
        SGLANG_IDS,
        VLLM_IDS,
    )
    assert "SGLang" in layout.describe() and str(VLLM_IDS) in layout.describe()
    # A top-level list that says the same ids in vLLM's counting (our SGLang export) is fine.
    assert detect_layout(sglang_config(eagle_aux_hidden_state_layer_ids=VLLM_IDS)).name == SGLANG
    spec = {"speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": VLLM_IDS}
    assert detect_layout(spec).aux_layer_ids == VLLM_IDS and detect_layout(spec).name == SPECULATORS
    mla = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "eagle_aux_hidden_state_layer_ids": [2],
    }
    assert detect_layout(mla).name == VLLM_MLA and detect_layout(mla).aux_layer_ids == [2]
    assert "SGLang would capture its default layers" in detect_layout(mla).note


def test_an_mla_config_states_its_ids_in_both_counts() -> None:
    """vLLM's and SGLang's MLA drafts share a class name: the top level is vLLM's counting,
    eagle_config SGLang's (id - 1). The legacy copy of vLLM's ids there reads (vLLM serves it
    right) with a note that SGLang would read it one layer off."""
    mla = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "eagle_aux_hidden_state_layer_ids": VLLM_IDS,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_IDS},
    }
    layout = detect_layout(mla)
    assert (layout.aux_layer_ids, layout.counting, layout.note) == (
        VLLM_IDS,
        COUNTING[VLLM_MLA],
        "",
    )
    legacy = detect_layout({**mla, "eagle_config": {"eagle_aux_hidden_state_layer_ids": VLLM_IDS}})
    assert legacy.aux_layer_ids == VLLM_IDS
    assert "one off" in legacy.note and str(SGLANG_IDS) in legacy.note
    assert "one off" in legacy.describe()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"architectures": ["LlamaForCausalLM"]}, r"matches no draft layout.*LlamaForCausalLM"),
        (
            sglang_config(speculators_model_type="eagle3"),
            "mixes draft layouts.*speculators_model_type",
        ),
        (
            sglang_config(architectures=["LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"]),
            "mixes draft layouts",
        ),
        (
            sglang_config(eagle_aux_hidden_state_layer_ids=SGLANG_IDS),
            r"is \[2, 30, 58\] in vLLM's counting.*top-level.*\[1, 29, 57\]",
        ),
        (
            {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [1]},
            "cannot be told",
        ),
        (sglang_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [-1]}), "non-negative"),
        (
            {
                "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": SGLANG_IDS},
            },
            r"only under eagle_config.*SGLang.*vLLM.*cannot be told",
        ),
        (
            {
                "architectures": ["Eagle3DeepseekV2ForCausalLM"],
                "eagle_aux_hidden_state_layer_ids": VLLM_IDS,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 31, 59]},
            },
            r"\[3, 31, 59\] are neither.*\[2, 30, 58\].*cannot be told",
        ),
    ],
)
def test_refusals_name_the_deciding_fields(config, message) -> None:
    with pytest.raises(DraftLayoutError, match=message):
        detect_layout(config, "draft/config.json")


def test_tensor_names() -> None:
    names = sglang_to_vllm_names(["midlayer.self_attn.q_proj.weight", "model.fc.weight", "d2t"])
    assert names == {
        "midlayer.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
        "model.fc.weight": "fc.weight",
        "d2t": "d2t",
    }
    with pytest.raises(DraftLayoutError, match="drop the residual"):
        sglang_to_vllm_names(["additional_layers.0.mlp.up_proj.weight"])
    with pytest.raises(DraftLayoutError, match="mix layouts"):
        sglang_to_vllm_names(["layers.0.mlp.up_proj.weight"])
