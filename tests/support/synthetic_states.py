"""Valid, learnable synthetic hidden-state datasets for benchmarks and tests, at any size (the
tests' vocab maps and target configs: tests/support/train.py).

The states are not random noise: the target's last hidden state at row ``t`` is a fixed
linear map of the embedding of ``x_t`` (plus noise), so the target distribution at row
``t+1`` is a function of the token the draft is fed at slot ``t`` — a draft trained with
the right shift learns it, and its loss falls. Written through eagle3-schemas, so every
file validates.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from eagle3_schemas.contract.header import (
    make_header,
    write_json_header,
    write_parquet,
    write_safetensors,
)
from eagle3_schemas.contract.lineage import fingerprint_json
from eagle3_schemas.layouts.hidden_states import SHARD_DIR, checksum_rows

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fake_fingerprint(label: str) -> str:
    return fingerprint_json({"synthetic": label})


def _bytes(t: torch.Tensor) -> bytes:
    if t.dtype == torch.bfloat16:
        t = t.view(torch.uint16)
    return t.contiguous().numpy().tobytes()


def write_samples(
    directory: Path,
    samples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    head: dict[str, torch.Tensor],
    target: dict[str, object],
    lineage: dict[str, object],
    aux_layer_ids: list[int],
    storage_dtype: str = "float32",
    samples_per_shard: int = 16,
    id_prefix: str = "sample",
    backend: str = "synthetic",
) -> Path:
    """A hidden_states artifact from (input_ids, loss_mask, aux [n, n_aux, H], last [n, H])
    per sample, packed ``samples_per_shard`` to a shard, with checksums and the header."""
    dtype = DTYPES[storage_dtype]
    directory.mkdir(parents=True)
    manifest: dict[str, list] = {
        k: []
        for k in ("sample_id", "shard", "row_start", "num_tokens", "num_loss_tokens", "checksum")
    }
    for shard_index, first in enumerate(range(0, len(samples), samples_per_shard)):
        group = samples[first : first + samples_per_shard]
        lengths = [int(s[0].shape[0]) for s in group]
        tensors = {
            "aux_hidden_states": torch.cat([s[2] for s in group]).to(dtype),
            "last_hidden_state": torch.cat([s[3] for s in group]).to(dtype),
            "input_ids": torch.cat([s[0] for s in group]).to(torch.int32),
            "loss_mask": torch.cat([s[1] for s in group]).to(torch.uint8),
            "cu_seqlens": torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=torch.int64),
        }
        rel = f"{SHARD_DIR}/shard-{shard_index:05d}.safetensors"
        write_safetensors(directory / rel, tensors)
        start = 0
        for j, n in enumerate(lengths):
            rows = {
                k: _bytes(tensors[k][start : start + n])
                for k in ("aux_hidden_states", "last_hidden_state", "input_ids", "loss_mask")
            }
            manifest["sample_id"].append(f"{id_prefix}-{first + j:06d}")
            manifest["shard"].append(rel)
            manifest["row_start"].append(start)
            manifest["num_tokens"].append(n)
            manifest["num_loss_tokens"].append(int(group[j][1].sum()))
            manifest["checksum"].append(checksum_rows(rows))
            start += n
    write_parquet(
        directory / "manifest.parquet",
        pa.table(
            {
                **{k: manifest[k] for k in ("sample_id", "shard", "checksum")},
                "row_start": pa.array(manifest["row_start"], pa.int64()),
                "num_tokens": pa.array(manifest["num_tokens"], pa.int32()),
                "num_loss_tokens": pa.array(manifest["num_loss_tokens"], pa.int32()),
            }
        ),
    )
    head_dtype = dtype if dtype != torch.float16 else torch.float32
    write_safetensors(
        directory / "target_head.safetensors",
        {k: v.to(head_dtype).contiguous() for k, v in head.items()},
    )
    header = make_header(
        "hidden_states",
        {**lineage, "aux_layer_ids": list(aux_layer_ids)},
        target=target,
        aux_layer_ids=list(aux_layer_ids),
        storage_dtype=storage_dtype,
        backend=backend,
        num_samples=len(samples),
        num_tokens=int(sum(manifest["num_tokens"])),
        shard_index=0,
        num_shards_total=1,
    )
    write_json_header(directory / "dataset.json", header)
    return directory


def synthetic_lineage(label: str) -> dict[str, str]:
    """The fingerprints of what a synthetic dataset came from (target, tokenizer, tokenized),
    derived from ``label``."""
    return {
        "target_fingerprint": fake_fingerprint(f"{label}/target"),
        "tokenizer_fingerprint": fake_fingerprint(f"{label}/tokenizer"),
        "tokenized_fingerprint": fake_fingerprint(f"{label}/tokenized"),
    }


def llama_target(hidden: int, num_layers: int, v_target: int, rms_norm_eps: float) -> dict:
    """The header's description of the Llama target whose states these are."""
    return {
        "architecture": "LlamaForCausalLM",
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "vocab_size": v_target,
        "rms_norm_eps": rms_norm_eps,
    }


def write_dataset(
    directory: Path,
    num_samples: int = 32,
    min_len: int = 16,
    max_len: int = 64,
    samples_per_shard: int = 16,
    hidden: int = 16,
    num_layers: int = 4,
    aux_layer_ids: tuple[int, ...] = (1, 2, 3),
    v_target: int = 64,
    storage_dtype: str = "float32",
    seed: int = 0,
    label: str = "synthetic",
    rms_norm_eps: float = 1e-6,
) -> Path:
    """A learnable synthetic hidden_states artifact; lineage fingerprints derive from ``label``."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(v_target, hidden, generator=g)
    mix = torch.randn(hidden, hidden, generator=g) / hidden**0.5
    lm_head = torch.randn(v_target, hidden, generator=g) * 2.0
    samples = []
    for n in torch.randint(min_len, max_len + 1, (num_samples,), generator=g).tolist():
        # a Markov-ish token stream: mostly id+1, sometimes a jump (learnable, not trivial)
        x = torch.empty(n, dtype=torch.int64)
        x[0] = int(torch.randint(0, v_target, (1,), generator=g))
        jumps = torch.rand(n, generator=g) < 0.3
        rand = torch.randint(0, v_target, (n,), generator=g)
        for t in range(1, n):
            x[t] = rand[t] if jumps[t] else (x[t - 1] + 1) % v_target
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[n // 4 :] = 1  # prompt first, answer after
        last = embed[x] @ mix + 0.05 * torch.randn(n, hidden, generator=g)
        aux = torch.stack(
            [
                last * (0.5 + 0.25 * i) + 0.1 * torch.randn(n, hidden, generator=g)
                for i in range(len(aux_layer_ids))
            ],
            dim=1,
        )
        samples.append((x, mask, aux, last))
    lineage = synthetic_lineage(label)
    target = llama_target(hidden, num_layers, v_target, rms_norm_eps)
    head = {
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": lm_head,
        "embed_tokens.weight": embed,
    }
    return write_samples(
        directory,
        samples,
        head,
        target,
        lineage,
        list(aux_layer_ids),
        storage_dtype,
        samples_per_shard,
        id_prefix=label,
    )
