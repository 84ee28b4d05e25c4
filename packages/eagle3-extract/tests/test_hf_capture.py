"""The transformers backend captures exactly vLLM's layer ids, on Llama, Qwen3 and DeepseekV3.

Reference: transformers' own ``output_hidden_states`` (computed unbatched, unpadded), whose
entry k < N is the residual stream after k layers and whose entry N is *after* the final norm.
So: captured id k == output_hidden_states[k] for k < N; final_norm(captured id N) ==
output_hidden_states[N]; and captured id N differs from output_hidden_states[N] (the trap).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle3_extract.backends.hf import HFBackend, LayerCapture, load_base_model
from eagle3_extract.config import default_aux_layer_ids
from eagle3_extract.samples import Sample

ARCHS = [("llama", 4), ("qwen3", 3), ("deepseek_v3", 3)]


def _samples(lengths: tuple[int, ...], seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    return [
        Sample(i, f"s{i}", rng.integers(0, 64, n).astype(np.int32), np.ones(n, np.uint8))
        for i, n in enumerate(lengths)
    ]


@pytest.mark.parametrize(("arch", "layers"), ARCHS)
def test_captured_ids_are_vllm_convention_and_id_n_is_pre_norm(
    arch: str, layers: int, target_factory: Callable[..., Path]
) -> None:
    model_dir = target_factory(arch, layers=layers)
    ids = list(range(layers + 1))  # every id, 0 = embeddings output .. N = last layer, pre-norm
    backend = HFBackend(model_dir, ids, batch_tokens=64)
    samples = _samples((7, 13, 4))
    captured = backend.capture(samples)  # batched and right-padded
    model = backend.model
    for sample, got in zip(samples, captured, strict=True):
        ref_ids = torch.from_numpy(sample.input_ids.astype(np.int64))[None]
        with torch.inference_mode():
            out = model(input_ids=ref_ids, output_hidden_states=True)
        hidden = out.hidden_states
        assert len(hidden) == layers + 1
        assert got.states.shape == (sample.num_tokens, layers + 1, 32)
        for k in range(layers):
            torch.testing.assert_close(got.states[:, k], hidden[k][0], rtol=1e-5, atol=1e-5)
        pre_norm = got.states[:, layers]
        with torch.inference_mode():
            torch.testing.assert_close(
                model.norm(pre_norm), hidden[layers][0], rtol=1e-5, atol=1e-5
            )
        # The post-norm trap: HF's output_hidden_states[N] is not id N.
        assert (pre_norm - hidden[layers][0]).abs().max() > 0.1


@pytest.mark.parametrize(("arch", "layers"), ARCHS)
def test_id_n_equals_a_hook_on_the_last_decoder_layer(
    arch: str, layers: int, target_factory: Callable[..., Path]
) -> None:
    model = load_base_model(target_factory(arch, layers=layers), torch.float32)
    seen: list[torch.Tensor] = []
    handle = model.layers[-1].register_forward_hook(
        lambda _m, _a, out: seen.append(out[0] if isinstance(out, tuple) else out)
    )
    ids = torch.arange(10)[None] % 64
    try:
        with torch.inference_mode(), LayerCapture(model, [layers]) as capture:
            model(input_ids=ids)
            (captured,) = capture.take()
    finally:
        handle.remove()
    assert torch.equal(captured, seen[0])


def test_batching_and_padding_do_not_change_states(llama_target: Path) -> None:
    samples = _samples((3, 17, 9, 1, 12), seed=3)
    one_by_one = HFBackend(llama_target, [1, 2, 4], batch_tokens=1).capture(samples)
    batched = HFBackend(llama_target, [1, 2, 4], batch_tokens=10_000).capture(samples)
    for a, b in zip(one_by_one, batched, strict=True):
        assert a.sample.sample_id == b.sample.sample_id
        torch.testing.assert_close(a.states, b.states, rtol=1e-5, atol=1e-5)


def test_self_check_passes_on_a_sound_model(llama_target: Path) -> None:
    backend = HFBackend(llama_target, [1, 2, 3, 4])
    assert backend.self_check(_samples((6,))[0]) == []


@pytest.mark.parametrize(
    ("layers", "expected"),
    [
        (2, [1, 2]),
        (4, [1, 2, 3]),
        (6, [2, 3, 5]),
        (7, [2, 3, 4]),
        (32, [2, 16, 29]),
        (61, [2, 30, 58]),
    ],
)
def test_default_aux_layer_ids(layers: int, expected: list[int]) -> None:
    assert default_aux_layer_ids(layers) == expected


def test_dataset_header_records_the_layer_shape_a_draft_copies(
    target_factory, tokenized: Path, tmp_path: Path
) -> None:
    """dataset.json ``target`` carries heads, MLP width and RoPE as the target's config states
    them, so the trainer can size the draft from the dataset without the target directory."""
    import json

    from eagle3_extract.config import ExtractConfig
    from eagle3_extract.run import run
    from eagle3_extract.target import LAYER_SHAPE_KEYS

    for arch in ("llama", "qwen3"):
        target = target_factory(arch)
        out = tmp_path / arch
        run(ExtractConfig(model=target, tokenized=tokenized, out=out, max_samples=2))
        recorded = json.loads((out / "dataset.json").read_text())["target"]
        config = json.loads((target / "config.json").read_text())
        expected = {k: config[k] for k in LAYER_SHAPE_KEYS if config.get(k) is not None}
        assert {"num_attention_heads", "num_key_value_heads", "intermediate_size"} <= set(expected)
        assert {k: recorded[k] for k in expected} == expected
