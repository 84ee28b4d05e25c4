"""Small, valid artifacts of every kind, built with numpy only.

For the tests of any stage: a stage that reads an artifact can test against these before the
stage that writes it exists. Hidden states are stored as float32 here (numpy has no bfloat16);
the schema allows it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from eagle3_schemas.contract.header import (
    make_header,
    write_json_header,
    write_parquet,
    write_safetensors,
)
from eagle3_schemas.contract.lineage import fingerprint_json, fingerprint_vocab_map
from eagle3_schemas.io.atomic import write_json_atomic
from eagle3_schemas.layouts.conversations import SCHEMA as CONVERSATIONS_SCHEMA
from eagle3_schemas.layouts.conversations import conversation_id
from eagle3_schemas.layouts.hidden_states import SHARD_DIR, checksum_rows

HIDDEN = 8
NUM_LAYERS = 4
AUX_LAYER_IDS = [1, 2, 3]
V_TARGET = 32
V_DRAFT = 12


def fake_fingerprint(label: str) -> str:
    return fingerprint_json({"fixture": label})


def conversations(path: Path) -> Path:
    rows = [
        [
            {"role": "user", "content": "Write hello."},
            {"role": "assistant", "content": "print('hello')"},
        ],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 1 and 2."},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "Times 4?"},
            {"role": "assistant", "content": "12"},
        ],
    ]
    table = pa.table(
        {
            "id": [conversation_id(m) for m in rows],
            "messages": rows,
            "source": ["fixture.jsonl:0", "fixture.jsonl:1"],
            "tools": ["[]", "[]"],
            "mode": ["instant", "instant"],
        },
        schema=CONVERSATIONS_SCHEMA,
    )
    lineage = {"source_fingerprint": fake_fingerprint("raw"), "generator": "original"}
    write_parquet(path, table, make_header("conversations", lineage, num_rows=2, num_rejected=0))
    return path


def _samples(
    rng: np.random.Generator, lengths: list[int]
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    ids = [rng.integers(0, V_TARGET, n).astype(np.int32) for n in lengths]
    masks = []
    for n in lengths:
        mask = np.zeros(n, np.uint8)
        mask[n // 2 :] = 1  # prompt first, answer second
        masks.append(mask)
    return ids, masks


def tokenized(path: Path, lengths: tuple[int, ...] = (5, 9, 7)) -> Path:
    ids, masks = _samples(np.random.default_rng(0), list(lengths))
    table = pa.table(
        {
            "id": [f"sample-{i}" for i in range(len(lengths))],
            "input_ids": pa.array([x.tolist() for x in ids], type=pa.list_(pa.int32())),
            "loss_mask": pa.array([m.tolist() for m in masks], type=pa.list_(pa.uint8())),
            "num_tokens": pa.array(list(lengths), type=pa.int32()),
            "num_loss_tokens": pa.array([int(m.sum()) for m in masks], type=pa.int32()),
        }
    )
    lineage = {
        "conversations_fingerprint": fake_fingerprint("conversations"),
        "tokenizer_fingerprint": fake_fingerprint("tokenizer"),
        "chat_template_fingerprint": fake_fingerprint("template"),
    }
    header = make_header(
        "tokenized",
        lineage,
        vocab_size=V_TARGET,
        max_length=2048,
        truncation="keep_prefix",
        answers={"generator": "original"},
    )
    write_parquet(path, table, header)
    return path


def vocab_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """token counts, d2t, t2d: the V_DRAFT most frequent target ids, ascending."""
    counts = np.arange(V_TARGET, dtype=np.int64)[::-1] % 7
    chosen = np.sort(np.argsort(-counts, kind="stable")[:V_DRAFT])
    d2t = chosen - np.arange(V_DRAFT)
    t2d = np.zeros(V_TARGET, dtype=bool)
    t2d[chosen] = True
    return counts, d2t.astype(np.int64), t2d


def vocab_map(path: Path) -> Path:
    counts, d2t, t2d = vocab_arrays()
    coverage = float(counts[np.arange(V_DRAFT) + d2t].sum() / counts.sum())
    lineage = {
        "tokenized_fingerprint": fake_fingerprint("tokenized"),
        "tokenizer_fingerprint": fake_fingerprint("tokenizer"),
    }
    header = make_header(
        "vocab_map",
        lineage,
        draft_vocab_size=V_DRAFT,
        target_vocab_size=V_TARGET,
        num_loss_tokens=int(counts.sum()),
        coverage=coverage,
    )
    write_safetensors(path, {"token_counts": counts, "d2t": d2t, "t2d": t2d}, header)
    return path


def hidden_states(
    directory: Path, shard_lengths: tuple[tuple[int, ...], ...] = ((5, 9), (7,))
) -> Path:
    """A dataset of float32 states; rows are deterministic functions of (sample, position)."""
    rng = np.random.default_rng(1)
    directory.mkdir(parents=True)
    manifest: dict[str, list] = {
        k: []
        for k in ("sample_id", "shard", "row_start", "num_tokens", "num_loss_tokens", "checksum")
    }
    sample = 0
    for shard_index, lengths in enumerate(shard_lengths):
        ids, masks = _samples(rng, list(lengths))
        total = sum(lengths)
        tensors = {
            "aux_hidden_states": rng.standard_normal((total, len(AUX_LAYER_IDS), HIDDEN)).astype(
                np.float32
            ),
            "last_hidden_state": rng.standard_normal((total, HIDDEN)).astype(np.float32),
            "input_ids": np.concatenate(ids),
            "loss_mask": np.concatenate(masks),
            "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        }
        rel = f"{SHARD_DIR}/shard-{shard_index:05d}.safetensors"
        write_safetensors(directory / rel, tensors)
        start = 0
        for n, mask in zip(lengths, masks, strict=True):
            rows = {
                k: tensors[k][start : start + n].tobytes()
                for k in ("aux_hidden_states", "last_hidden_state", "input_ids", "loss_mask")
            }
            for key, value in (
                ("sample_id", f"sample-{sample}"),
                ("shard", rel),
                ("row_start", start),
                ("num_tokens", n),
                ("num_loss_tokens", int(mask.sum())),
                ("checksum", checksum_rows(rows)),
            ):
                manifest[key].append(value)
            start += n
            sample += 1
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
    head = {
        "norm.weight": np.ones(HIDDEN, np.float32),
        "lm_head.weight": rng.standard_normal((V_TARGET, HIDDEN)).astype(np.float32),
        "embed_tokens.weight": rng.standard_normal((V_TARGET, HIDDEN)).astype(np.float32),
    }
    write_safetensors(directory / "target_head.safetensors", head)
    lineage = {
        "target_fingerprint": fake_fingerprint("target"),
        "tokenizer_fingerprint": fake_fingerprint("tokenizer"),
        "tokenized_fingerprint": fake_fingerprint("tokenized"),
        "aux_layer_ids": AUX_LAYER_IDS,
    }
    header = make_header(
        "hidden_states",
        lineage,
        target={
            "architecture": "LlamaForCausalLM",
            "hidden_size": HIDDEN,
            "num_hidden_layers": NUM_LAYERS,
            "vocab_size": V_TARGET,
        },
        aux_layer_ids=AUX_LAYER_IDS,
        storage_dtype="float32",
        backend="fixture",
        num_samples=sample,
        num_tokens=sum(manifest["num_tokens"]),
        shard_index=0,
        num_shards_total=1,
    )
    write_json_header(directory / "dataset.json", header)
    return directory


def draft_config(verifier_path: str = "fixture-target") -> dict:
    """A speculators-format eagle3 config.json for the fixture sizes."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "draft_vocab_size": V_DRAFT,
        "norm_before_residual": False,
        "target_hidden_size": HIDDEN,
        "eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS,
        "transformer_layer_config": {
            "model_type": "llama",
            "hidden_size": HIDDEN,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": HIDDEN // 2,
            "intermediate_size": 2 * HIDDEN,
            "vocab_size": V_TARGET,
            "rms_norm_eps": 1e-5,
            "num_hidden_layers": 1,
            "max_position_embeddings": 2048,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
        },
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": verifier_path, "architectures": ["LlamaForCausalLM"]},
        },
    }


def draft_checkpoint(directory: Path) -> Path:
    rng = np.random.default_rng(2)
    directory.mkdir(parents=True)
    h, head_dim = HIDDEN, HIDDEN // 2

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    _, d2t, t2d = vocab_arrays()
    weights = {
        "fc.weight": w(h, len(AUX_LAYER_IDS) * h),
        "layers.0.self_attn.q_proj.weight": w(2 * head_dim, 2 * h),
        "layers.0.self_attn.k_proj.weight": w(head_dim, 2 * h),
        "layers.0.self_attn.v_proj.weight": w(head_dim, 2 * h),
        "layers.0.self_attn.o_proj.weight": w(h, 2 * head_dim),
        "layers.0.mlp.gate_proj.weight": w(2 * h, h),
        "layers.0.mlp.up_proj.weight": w(2 * h, h),
        "layers.0.mlp.down_proj.weight": w(h, 2 * h),
        "layers.0.input_layernorm.weight": np.ones(h, np.float32),
        "layers.0.hidden_norm.weight": np.ones(h, np.float32),
        "layers.0.post_attention_layernorm.weight": np.ones(h, np.float32),
        "norm.weight": np.ones(h, np.float32),
        "lm_head.weight": w(V_DRAFT, h),
        "d2t": d2t,
        "t2d": t2d,
    }
    write_safetensors(directory / "model.safetensors", weights)
    write_json_atomic(directory / "config.json", draft_config())
    lineage = {
        "target_fingerprint": fake_fingerprint("target"),
        "tokenizer_fingerprint": fake_fingerprint("tokenizer"),
        "hidden_states_fingerprint": fake_fingerprint("hidden_states"),
        "vocab_map_fingerprint": fingerprint_vocab_map(d2t, t2d),
    }
    write_json_header(
        directory / "eagle3.json",
        make_header(
            "draft_checkpoint",
            lineage,
            aux_layer_ids=AUX_LAYER_IDS,
            training={"steps": 0},
            architecture="llama",
        ),
    )
    return directory


GROUP_FIGURES = (
    "num_prompts",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "acceptance_length",
    "per_position_acceptance",
)


def eval_report(directory: Path) -> Path:
    directory.mkdir(parents=True)
    drafts, accepted_per_pos = [4, 6], [[3, 2, 1], [5, 3, 1]]
    write_parquet(
        directory / "samples.parquet",
        pa.table(
            {
                "sample_id": ["p0", "p1"],
                "num_drafts": pa.array(drafts, pa.int64()),
                "num_accepted_tokens": pa.array([sum(a) for a in accepted_per_pos], pa.int64()),
                "num_generated_tokens": pa.array([10, 15], pa.int64()),
                "prompt_set": ["heldout", "heldout"],
                "category": pa.array([None, None], pa.string()),
            }
        ),
    )
    total_drafts = sum(drafts)
    per_pos = [sum(a[i] for a in accepted_per_pos) / total_drafts for i in range(3)]
    accepted = sum(map(sum, accepted_per_pos))
    lineage = {
        "draft_fingerprint": fake_fingerprint("draft"),
        "target_fingerprint": fake_fingerprint("target"),
        "prompts_fingerprint": fake_fingerprint("prompts"),
    }
    header = make_header(
        "eval_report",
        lineage,
        mode="reference",
        num_speculative_tokens=3,
        temperature=0.0,
        engine={"name": "fixture"},
        num_prompts=2,
        num_drafts=total_drafts,
        num_draft_tokens=3 * total_drafts,
        num_accepted_tokens=accepted,
        acceptance_length=1 + accepted / total_drafts,
        per_position_acceptance=per_pos,
    )
    whole_set = {
        "prompt_set": "heldout",
        "category": None,
        **{key: header.fields[key] for key in GROUP_FIGURES},
    }
    header.fields["groups"] = [whole_set]
    write_json_header(directory / "report.json", header)
    return directory


BUILDERS = {
    "conversations": ("conversations.parquet", conversations),
    "tokenized": ("tokenized.parquet", tokenized),
    "vocab_map": ("vocab_map.safetensors", vocab_map),
    "hidden_states": ("hidden_states", hidden_states),
    "draft_checkpoint": ("draft", draft_checkpoint),
    "eval_report": ("eval", eval_report),
}


def build(kind: str, parent: Path) -> Path:
    """A valid ``kind`` artifact under ``parent``; returns its path."""
    name, builder = BUILDERS[kind]
    return builder(parent / name)
