"""A speculators-layout draft rewritten by hand in the SpecForge / SGLang layout, as SpecForge's
exporter and SGLang's ``llama_eagle3.py`` read it — independently of
``eagle3_schemas.layouts.draft_layout``, so that tests of the readers and of the exporter are held to
SGLang's source, not to our own rule:

- SGLang's target captures before layer ``id + 1`` (``set_eagle3_layers_to_capture``), vLLM's
  before layer ``id``: the SGLang id of vLLM's id k is k - 1, written under ``eagle_config``;
- layer 0's tensors are ``midlayer.*``; ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` keep
  their names;
- a flat Llama config naming ``LlamaForCausalLMEagle3``.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file


def sglang_copy(src: Path, dst: Path) -> Path:
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    layer = config["transformer_layer_config"]
    assert not config.get("norm_before_residual", True), "SGLang's layer 0 never norms the residual"
    out = {
        **{k: v for k, v in layer.items() if k not in ("architectures", "model_type")},
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "draft_vocab_size": config["draft_vocab_size"],
        "target_hidden_size": config["target_hidden_size"],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [
                k - 1 for k in config["eagle_aux_hidden_state_layer_ids"]
            ],
            "use_aux_hidden_state": True,
        },
    }
    tensors = {
        ("midlayer." + n[len("layers.0.") :] if n.startswith("layers.0.") else n): t
        for n, t in load_file(str(src / "model.safetensors")).items()
    }
    dst.mkdir(parents=True)
    (dst / "config.json").write_text(json.dumps(out, indent=2), encoding="utf-8")
    save_file(tensors, str(dst / "model.safetensors"))
    return dst
