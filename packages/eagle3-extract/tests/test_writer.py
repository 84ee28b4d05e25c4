"""The writer: datasets that validate, hold the right numbers, account their bytes, reject NaN."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3_extract.backends.hf import HFBackend
from eagle3_extract.config import ExtractConfig
from eagle3_extract.plan import bytes_per_token, hidden_bytes_per_token
from eagle3_extract.reader import DatasetReader
from eagle3_extract.run import run
from eagle3_extract.samples import read_tokenized
from eagle3_extract.storage import STORAGE_RELATIVE_ERROR, decode, encode
from eagle3_schemas import fingerprint_artifact, fingerprint_model_dir, read_header, validate
from eagle3_schemas.io.safetensors_format import read_safetensors

from support import fixtures


def _run(model: Path, tokenized: Path, out: Path, **kwargs) -> dict:
    return run(ExtractConfig(model=model, tokenized=tokenized, out=out, **kwargs))


def test_dataset_validates_and_holds_the_reference_states(
    llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ds"
    summary = _run(llama_target, tokenized, out, shard_mb=0.004)  # a few samples per shard
    assert summary["status"] == "complete" and summary["samples"] == 8
    assert validate(out) == []
    assert not (out / "_work").exists() and not out.with_name("ds.partial").exists()
    assert len(list((out / "shards").glob("*.safetensors"))) > 1

    header = read_header(out)
    f = header.fields
    assert f["aux_layer_ids"] == [1, 2, 3] and f["last_hidden_state_layer_id"] == 4
    assert f["storage_dtype"] == "bfloat16" and f["compute_dtype"] == "float32"
    assert f["target"]["rms_norm_eps"] == 1e-6 and f["target"]["hidden_size"] == 32
    assert f["backend"] == "hf" and f["shard_index"] == 0 and f["num_shards_total"] == 1
    tok_header = read_header(tokenized)
    assert header.lineage == {
        "target_fingerprint": fingerprint_model_dir(llama_target),
        "tokenizer_fingerprint": tok_header.lineage["tokenizer_fingerprint"],
        "tokenized_fingerprint": fingerprint_artifact(tokenized),
        "aux_layer_ids": [1, 2, 3],
        "trust_remote_code": False,  # the choice is recorded even when nothing needed it
        "remote_code_files": [],
    }

    # Stored states are the reference states rounded to bf16, tokens as tokenized.
    samples = read_tokenized(tokenized).samples
    reference = HFBackend(llama_target, [1, 2, 3, 4]).capture(samples)
    reader = DatasetReader(out)
    assert sorted(reader.manifest["sample_id"]) == sorted(s.sample_id for s in samples)
    for ref in reference:
        stored = reader.sample(reader.row_of[ref.sample.sample_id])
        np.testing.assert_array_equal(stored.input_ids, ref.sample.input_ids)
        np.testing.assert_array_equal(stored.loss_mask, ref.sample.loss_mask)
        # Other batch shapes than here: float32 sums may differ in the last bit, which can flip
        # the bf16 rounding of a value by one unit (2^-7 relative).
        torch.testing.assert_close(
            stored.states, ref.states.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6
        )

    # The target head is the model's own final norm, LM head and embeddings.
    head = load_file(out / "target_head.safetensors")
    weights = load_file(llama_target / "model.safetensors")
    assert torch.equal(head["norm.weight"], weights["model.norm.weight"])
    assert torch.equal(head["lm_head.weight"], weights["lm_head.weight"])
    assert torch.equal(head["embed_tokens.weight"], weights["model.embed_tokens.weight"])


def test_rerun_of_a_complete_dataset_is_a_no_op(
    llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ds"
    _run(llama_target, tokenized, out)
    before = fingerprint_artifact(out)
    assert _run(llama_target, tokenized, out)["status"] == "already complete"
    assert fingerprint_artifact(out) == before


@pytest.mark.parametrize("storage", ["bfloat16", "fp8_e4m3"])
def test_bytes_per_token(storage: str, target_factory: Callable[..., Path], tmp_path: Path) -> None:
    """Hidden-state bytes are exactly (n_aux+1)*H*2 per token for bf16 (half that, plus one
    float32 scale per layer, for fp8); the whole shard file stays within 1 % of that at H=256."""
    hidden = 256
    model = target_factory("llama", hidden=hidden, layers=4)
    tokenized = fixtures.tokenized(tmp_path / "t.parquet", lengths=(120, 97, 143, 88))
    out = tmp_path / "ds"
    _run(model, tokenized, out, storage_dtype=storage)
    n_aux, tokens = 3, 120 + 97 + 143 + 88
    shard_bytes = sum(p.stat().st_size for p in (out / "shards").glob("*.safetensors"))
    st = read_safetensors(next((out / "shards").glob("*.safetensors")))
    states = sum(
        info.end - info.start
        for name, info in st.tensors.items()
        if name.startswith(("aux_hidden_states", "last_hidden_state"))
    )
    nominal = (n_aux + 1) * hidden * 2
    assert states == tokens * hidden_bytes_per_token(n_aux, hidden, storage)
    if storage == "bfloat16":
        assert states == tokens * nominal
        assert shard_bytes / tokens < nominal * 1.01
    else:
        assert states == tokens * (nominal // 2 + 4 * (n_aux + 1))
        assert shard_bytes / tokens < (nominal // 2) * 1.03  # scales: 16 B/token at H=256
    assert shard_bytes >= tokens * bytes_per_token(n_aux, hidden, storage)


def test_fp8_round_trip_error_is_bounded() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 4, 256) * torch.logspace(-3, 2, 64).reshape(64, 1, 1)
    x[5, 2, 7] = 300.0  # an outlier dominates its row's scale
    x[9, 1] = 0.0  # an all-zero row
    enc = encode(x, "fp8_e4m3")
    assert enc.values.dtype == torch.float8_e4m3fn and enc.scale.shape == (64, 4)
    back = decode(enc.values, enc.scale)
    row_err = (back - x).abs().amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    assert float(row_err.max()) <= STORAGE_RELATIVE_ERROR["fp8_e4m3"]
    assert torch.equal(back[9, 1], torch.zeros(256))
    # Element-wise, normal values keep 3 mantissa bits: relative error <= 2^-4.
    normal = back.abs() >= enc.scale.unsqueeze(-1) * 2**-6
    rel = ((back - x).abs() / x.abs().clamp_min(1e-30))[normal]
    assert float(rel.max()) <= 2**-4


def test_fp8_dataset_validates_and_decodes_close(
    llama_target: Path, tokenized: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ds"
    _run(llama_target, tokenized, out, storage_dtype="fp8_e4m3")
    assert validate(out) == []
    samples = read_tokenized(tokenized).samples
    reference = HFBackend(llama_target, [1, 2, 3, 4]).capture(samples)
    reader = DatasetReader(out)
    for ref in reference:
        stored = reader.sample(reader.row_of[ref.sample.sample_id]).states
        err = (stored - ref.states).abs().amax(-1) / ref.states.abs().amax(-1)
        assert float(err.max()) <= 2**-4


def test_nan_samples_are_rejected_and_logged(
    target_factory: Callable[..., Path],
    tokenized: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A target whose embedding row for one token is NaN: every sample containing that token
    gets NaN states; those samples are left out, logged, and listed in dataset.json."""
    source = target_factory("llama", seed=1)
    poisoned = tmp_path / "poisoned"
    poisoned.mkdir()
    weights = load_file(source / "model.safetensors")
    samples = read_tokenized(tokenized).samples
    # Not token 0: the backend pads with it, and NaN keys poison masked attention rows too.
    bad_token = next(int(t) for t in samples[2].input_ids[::-1] if t != 0)
    weights["model.embed_tokens.weight"][bad_token] = float("nan")
    from safetensors.torch import save_file

    save_file(weights, poisoned / "model.safetensors", metadata={"format": "pt"})
    (poisoned / "config.json").write_text((source / "config.json").read_text())
    expected_bad = {s.sample_id for s in samples if bad_token in s.input_ids.tolist()}
    assert 0 < len(expected_bad) < len(samples)

    out = tmp_path / "ds"
    with caplog.at_level(logging.WARNING, logger="eagle3_extract"):
        summary = _run(poisoned, tokenized, out)
    assert summary["rejected"] == len(expected_bad)
    assert validate(out) == []
    header = json.loads((out / "dataset.json").read_text())
    assert {r["sample_id"] for r in header["rejected_samples"]} == expected_bad
    assert all("NaN/Inf" in r["reason"] for r in header["rejected_samples"])
    kept = set(DatasetReader(out).manifest["sample_id"])
    assert kept == {s.sample_id for s in samples} - expected_bad
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"rejected sample {sid!r}" in logged for sid in expected_bad)
