"""Fuzzed layout detection: any draft ``config.json`` object gets a Layout or a DraftLayoutError.

Configs mix the fields that decide a layout (``architectures``, the speculators keys,
``eagle_config``, the aux ids at either level) with values of any JSON type.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from eagle3_schemas.layouts.draft_layout import (
    SGLANG_ARCHITECTURES,
    VLLM_MLA_ARCHITECTURES,
    DraftLayoutError,
    Layout,
    detect_layout,
)

from support.fuzz import FUZZ, json_of, outcome

READER = "draft layout (detect_layout)"
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**64)
    | st.floats(allow_nan=True)
    | st.text(max_size=6)
)
ANY_JSON = json_of(SCALARS)
IDS = st.lists(st.integers(0, 8), max_size=4) | ANY_JSON
ARCHS = st.lists(
    st.sampled_from([*SGLANG_ARCHITECTURES, *VLLM_MLA_ARCHITECTURES, "LlamaForCausalLM"])
    | ANY_JSON,
    max_size=3,
)
CONFIG = st.fixed_dictionaries(
    {},
    optional={
        "architectures": ARCHS | ANY_JSON,
        "speculators_model_type": st.sampled_from(["eagle3", "eagle"]) | ANY_JSON,
        "transformer_layer_config": st.just({}) | ANY_JSON,
        "speculators_config": ANY_JSON,
        "eagle_config": st.fixed_dictionaries(
            {}, optional={"eagle_aux_hidden_state_layer_ids": IDS}
        )
        | ANY_JSON,
        "eagle_aux_hidden_state_layer_ids": IDS,
    },
)


@FUZZ
@given(config=CONFIG)
def test_any_config_gets_a_layout_or_a_named_refusal(config: dict[str, Any]) -> None:
    result = outcome(READER, lambda: detect_layout(config, "config.json"), (DraftLayoutError,))
    if isinstance(result, Layout):
        result.describe()
    else:
        assert str(result).startswith("config.json"), result


def test_architectures_that_is_not_a_list() -> None:
    """Found by the property above: ``architectures: true`` raised TypeError (not iterable)."""
    import pytest

    with pytest.raises(DraftLayoutError, match=r"^config.json: architectures True must be a list"):
        detect_layout({"architectures": True}, "config.json")
