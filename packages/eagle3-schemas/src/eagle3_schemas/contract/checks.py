"""The named semantic checks that the schema files declare, one function per name.

Each check takes the structurally valid ``Artifact`` and returns its violations. The
meta-check fails when a schema declares a check missing here, or the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pyarrow.compute as pc

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.io.fingerprint import fingerprint_vocab_map
from eagle3_schemas.io.safetensors_format import nonfinite_count
from eagle3_schemas.layouts.conversations import MODES, conversation_problem, tools_problem
from eagle3_schemas.layouts.draft_vocab import (
    checkpoint_vocab_map,
    serving_problems,
    stores_vocab_map,
)
from eagle3_schemas.layouts.hidden_states import (
    UnsafeShardPath,
    checksum_algorithm,
    resolve_shard_path,
    row_checksum,
)

Check = Callable[[Artifact], list[Violation]]
MAX_REPORTED = 5  # per check, so a fully corrupt file does not print millions of lines


def symbols_from_header(art: Artifact) -> dict[str, int]:
    """Shape symbols fixed by the header (or config), before any tensor is read."""
    f = art.header.fields
    if art.kind == "tokenized":
        return {"V_target": f["vocab_size"]}
    if art.kind == "vocab_map":
        return {"V_target": f["target_vocab_size"], "V_draft": f["draft_vocab_size"]}
    if art.kind == "hidden_states":
        t = f["target"]
        return {
            "H": t["hidden_size"],
            "V_target": t["vocab_size"],
            "n_aux": len(f["aux_layer_ids"]),
        }
    if art.kind == "draft_checkpoint":
        config = art.json(art.root / "config.json")
        if "transformer_layer_config" not in config:
            return mla_draft_symbols(config)
        layer = config["transformer_layer_config"]
        head_dim = layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]
        return {
            **_draft_symbols(config, layer),
            "q_dim": layer["num_attention_heads"] * head_dim,
            "kv_dim": layer["num_key_value_heads"] * head_dim,
            "o_dim": layer["num_attention_heads"] * head_dim,
        }
    return {}


def _draft_symbols(config: dict[str, Any], layer: dict[str, Any]) -> dict[str, int]:
    """The symbols both draft variants share; ``layer`` holds the decoder layer's sizes (the
    Llama layout's transformer_layer_config, the MLA layout's top level)."""
    hidden = layer["hidden_size"]
    return {
        "H": hidden,
        "two_H": 2 * hidden,
        "V_draft": config["draft_vocab_size"],
        "V_target": layer["vocab_size"],
        "n_aux_H": len(config["eagle_aux_hidden_state_layer_ids"])
        * (config.get("target_hidden_size") or hidden),
        "I": layer["intermediate_size"],
    }


def mla_draft_symbols(config: dict[str, Any]) -> dict[str, int]:
    """Shape symbols of an MLA draft's native config.json (draft_checkpoint v2, variant mla)."""
    heads = config["num_attention_heads"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    return {
        **_draft_symbols(config, config),
        "q_lora": config["q_lora_rank"],
        "q_b_dim": heads * (nope + rope),
        "kv_lora": config["kv_lora_rank"],
        "kv_a_dim": config["kv_lora_rank"] + rope,
        "kv_b_dim": heads * (nope + v),
        "o_dim": heads * v,
    }


def _capped(violations: list[Violation]) -> list[Violation]:
    if len(violations) <= MAX_REPORTED:
        return violations
    first = violations[0]
    return [
        *violations[:MAX_REPORTED],
        Violation(
            first.file, first.location, f"... and {len(violations) - MAX_REPORTED} more like these"
        ),
    ]


def _where(art: Artifact, role: str) -> str:
    return art.rel(art.path(role))


# ---- shared by several kinds -------------------------------------------------------------


def _duplicates(
    where: str, rows: Iterable[tuple[int, str]], column: str, noun: str
) -> list[Violation]:
    """A violation per (row, value) whose value an earlier row already holds."""
    seen: dict[str, int] = {}
    out = []
    for row, value in rows:
        if value in seen:
            message = f"duplicate {noun} {value!r} (first at row {seen[value]})"
            out.append(Violation(where, f"row {row}, column {column}", message))
        seen.setdefault(value, row)
    return _capped(out)


def _unique_ids(art: Artifact, role: str) -> list[Violation]:
    batches = art.batches(art.path(role), ["id"])
    rows = (
        (first + i, v) for first, b in batches for i, v in enumerate(b.column("id").to_pylist())
    )
    return _duplicates(_where(art, role), rows, "id", "id")


def _d2t_offsets(where: str, d2t: np.ndarray, v_target: int) -> list[Violation]:
    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t
    out = []
    bad = np.flatnonzero((target_ids < 0) | (target_ids >= v_target))
    for i in bad[:MAX_REPORTED]:
        out.append(
            Violation(
                where,
                f"tensor d2t[{i}]",
                f"maps draft id {i} to target id {target_ids[i]}, outside [0, {v_target}) (d2t holds offsets: target = i + d2t[i])",
            )
        )
    unsorted = np.flatnonzero(np.diff(target_ids) <= 0)
    for i in unsorted[:MAX_REPORTED]:
        out.append(
            Violation(
                where,
                f"tensor d2t[{i + 1}]",
                f"target id {target_ids[i + 1]} does not exceed draft id {i}'s {target_ids[i]} (draft ids must be sorted ascending by target id, no repeats)",
            )
        )
    return _capped(out)


def _t2d_matches(where: str, d2t: np.ndarray, t2d: np.ndarray) -> list[Violation]:
    target_ids = np.arange(len(d2t), dtype=np.int64) + d2t
    expected = np.zeros(len(t2d), dtype=bool)
    expected[target_ids[(target_ids >= 0) & (target_ids < len(t2d))]] = True
    diff = np.flatnonzero(expected != t2d)
    return _capped(
        [
            Violation(
                where,
                f"tensor t2d[{i}]",
                f"is {bool(t2d[i])} but target id {i} is {'' if expected[i] else 'not '}in d2t's draft vocabulary",
            )
            for i in diff[: MAX_REPORTED + 1]
        ]
    )


# ---- conversations -----------------------------------------------------------------------


def conversations_unique_ids(art: Artifact) -> list[Violation]:
    return _unique_ids(art, "conversations")


def conversations_roles_alternate(art: Artifact) -> list[Violation]:
    out = []
    for first, batch in art.batches(art.path("conversations"), ["messages"]):
        for offset, messages in enumerate(batch.column("messages").to_pylist()):
            problem = conversation_problem(messages, art.header.schema_version)
            if problem:
                out.append(
                    Violation(
                        _where(art, "conversations"),
                        f"row {first + offset}, column messages",
                        problem,
                    )
                )
    return _capped(out)


def conversations_tools_and_mode(art: Artifact) -> list[Violation]:
    out = []
    for first, batch in art.batches(art.path("conversations"), ["tools", "mode"]):
        d = batch.to_pydict()
        for offset, (tools, mode) in enumerate(zip(d["tools"], d["mode"], strict=True)):
            row = first + offset
            problem = tools_problem(tools)
            if problem:
                out.append(
                    Violation(_where(art, "conversations"), f"row {row}, column tools", problem)
                )
            if mode not in MODES:
                out.append(
                    Violation(
                        _where(art, "conversations"),
                        f"row {row}, column mode",
                        f"{mode!r} (expected one of {list(MODES)})",
                    )
                )
    return _capped(out)


# ---- tokenized ---------------------------------------------------------------------------


def tokenized_unique_ids(art: Artifact) -> list[Violation]:
    return _unique_ids(art, "tokenized")


def tokenized_row_lengths(art: Artifact) -> list[Violation]:
    max_length = art.header.fields["max_length"]
    out = []
    for first, batch in art.batches(
        art.path("tokenized"), ["input_ids", "loss_mask", "num_tokens"]
    ):
        ids_len = pc.list_value_length(batch.column("input_ids")).to_numpy(zero_copy_only=False)
        mask_len = pc.list_value_length(batch.column("loss_mask")).to_numpy(zero_copy_only=False)
        num = batch.column("num_tokens").to_numpy()
        for row in np.flatnonzero(
            (ids_len != mask_len) | (ids_len != num) | (num <= 0) | (num > max_length)
        ):
            out.append(
                Violation(
                    _where(art, "tokenized"),
                    f"row {first + row}",
                    f"len(input_ids)={ids_len[row]}, len(loss_mask)={mask_len[row]}, num_tokens={num[row]}: expected all equal and in [1, {max_length}]",
                )
            )
    return _capped(out)


def tokenized_loss_mask_binary(art: Artifact) -> list[Violation]:
    out, where, bad_values = [], _where(art, "tokenized"), set()
    for first, batch in art.batches(art.path("tokenized"), ["loss_mask", "num_loss_tokens"]):
        masks = batch.column("loss_mask")
        flat = pc.list_flatten(masks).to_numpy(zero_copy_only=False)
        bad_values |= set(np.unique(flat[flat > 1]).tolist())
        lengths = pc.list_value_length(masks).to_numpy(zero_copy_only=False)
        rows = np.repeat(np.arange(len(lengths)), lengths)
        sums = np.bincount(rows, weights=flat, minlength=len(lengths)).astype(np.int64)
        declared = batch.column("num_loss_tokens").to_numpy()
        for row in np.flatnonzero(sums != declared):
            out.append(
                Violation(
                    where,
                    f"row {first + row}, column num_loss_tokens",
                    f"is {declared[row]} but loss_mask sums to {sums[row]}",
                )
            )
    if bad_values:
        out.insert(
            0,
            Violation(
                where,
                "column loss_mask",
                f"values {sorted(bad_values)[:5]} found, expected only 0 and 1",
            ),
        )
    return _capped(out)


def tokenized_token_ids_in_vocab(art: Artifact) -> list[Violation]:
    vocab = art.header.fields["vocab_size"]
    out = []
    for first, batch in art.batches(art.path("tokenized"), ["input_ids"]):
        ids = batch.column("input_ids")
        flat = pc.list_flatten(ids).to_numpy(zero_copy_only=False)
        bad = np.flatnonzero((flat < 0) | (flat >= vocab))
        if len(bad):
            lengths = pc.list_value_length(ids).to_numpy(zero_copy_only=False)
            rows = np.repeat(np.arange(len(lengths)), lengths)[bad]
            for row in np.unique(rows)[: MAX_REPORTED + 1]:
                values = flat[bad[rows == row]][:5].tolist()
                out.append(
                    Violation(
                        _where(art, "tokenized"),
                        f"row {first + row}, column input_ids",
                        f"token ids {values} outside [0, {vocab})",
                    )
                )
    return _capped(out)


# ---- vocab_map ---------------------------------------------------------------------------


def vocab_map_d2t_offsets(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("vocab_map"))
    return _d2t_offsets(str(art.root), st.array("d2t"), st.tensors["t2d"].shape[0])


def vocab_map_t2d_matches_d2t(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("vocab_map"))
    return _t2d_matches(str(art.root), st.array("d2t"), st.array("t2d"))


def vocab_map_counts_nonnegative(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("vocab_map"))
    counts, d2t = st.array("token_counts"), st.array("d2t")
    f = art.header.fields
    out = []
    if np.any(counts < 0):
        out.append(
            Violation(
                str(art.root),
                "tensor token_counts",
                f"{int(np.count_nonzero(counts < 0))} negative counts",
            )
        )
    if int(counts.sum()) != f["num_loss_tokens"]:
        out.append(
            Violation(
                str(art.root),
                "header.num_loss_tokens",
                f"is {f['num_loss_tokens']} but token_counts sum to {int(counts.sum())}",
            )
        )
    total = max(int(counts.sum()), 1)
    covered = int(counts[np.arange(len(d2t)) + d2t].sum()) / total
    if abs(covered - f["coverage"]) > 1e-6:
        out.append(
            Violation(
                str(art.root),
                "header.coverage",
                f"is {f['coverage']} but the draft vocabulary covers {covered:.6f} of loss tokens",
            )
        )
    return out


# ---- hidden_states -----------------------------------------------------------------------


def hidden_states_layer_ids(art: Artifact) -> list[Violation]:
    f = art.header.fields
    ids, n_layers = f["aux_layer_ids"], f["target"]["num_hidden_layers"]
    where, out = _where(art, "dataset"), []
    if ids != sorted(set(ids)):
        out.append(
            Violation(
                where, "header.aux_layer_ids", f"{ids} must be sorted ascending without repeats"
            )
        )
    if any(not 0 <= i <= n_layers for i in ids):
        out.append(
            Violation(
                where,
                "header.aux_layer_ids",
                f"{ids} outside [0, {n_layers}] (vLLM convention: 0 = embeddings, {n_layers} = last layer before the final norm)",
            )
        )
    if art.header.lineage.get("aux_layer_ids") != ids:
        out.append(
            Violation(
                where,
                "header.lineage.aux_layer_ids",
                f"{art.header.lineage.get('aux_layer_ids')} differs from header aux_layer_ids {ids}",
            )
        )
    return out


def _manifest(art: Artifact) -> dict[str, list[Any]]:
    return art.table(art.path("manifest")).to_pydict()


def hidden_states_shard_paths_inside(art: Artifact) -> list[Violation]:
    out = []
    for row, shard in enumerate(_manifest(art)["shard"]):
        try:
            path = resolve_shard_path(art.root, shard)
        except UnsafeShardPath as e:
            out.append(Violation(_where(art, "manifest"), f"row {row}, column shard", str(e)))
            continue
        if not path.is_file():
            out.append(
                Violation(
                    _where(art, "manifest"), f"row {row}, column shard", f"{shard!r} does not exist"
                )
            )
    return _capped(out)


def _rows_by_shard(art: Artifact) -> dict[str, list[tuple[int, int, int, int, str]]]:
    m = _manifest(art)
    grouped: dict[str, list[tuple[int, int, int, int, str]]] = {}
    for row, (shard, start, n, n_loss, checksum) in enumerate(
        zip(
            m["shard"],
            m["row_start"],
            m["num_tokens"],
            m["num_loss_tokens"],
            m["checksum"],
            strict=True,
        )
    ):
        grouped.setdefault(shard, []).append((row, start, n, n_loss, checksum))
    return grouped


def hidden_states_manifest_rows(art: Artifact) -> list[Violation]:
    if hidden_states_shard_paths_inside(art):
        return []  # reported there
    out, where = [], _where(art, "manifest")
    listed = {resolve_shard_path(art.root, s) for s in _manifest(art)["shard"]}
    for path in art.files["shards"]:
        if path.resolve() not in listed:
            out.append(Violation(art.rel(path), "(file)", "shard is not listed in the manifest"))
    for shard, rows in _rows_by_shard(art).items():
        st = art.safetensors(resolve_shard_path(art.root, shard))
        cu = st.array("cu_seqlens")
        loss_mask = st.array("loss_mask")
        total = st.tensors["input_ids"].shape[0]
        rows = sorted(rows, key=lambda r: r[1])
        spans = [(int(start), int(start) + int(n)) for _, start, n, _, _ in rows]
        if (
            cu.tolist() != [0, *(end for _, end in spans)]
            or (spans and spans[0][0] != 0)
            or cu[-1] != total
        ):
            out.append(
                Violation(
                    where,
                    f"shard {shard}",
                    f"manifest rows {spans[:3]}... do not tile the shard's cu_seqlens {cu.tolist()[:4]}... over {total} tokens",
                )
            )
            continue
        for row, start, n, n_loss, _ in rows:
            stored = int(loss_mask[start : start + n].sum())
            if stored != n_loss:
                out.append(
                    Violation(
                        where,
                        f"row {row}, column num_loss_tokens",
                        f"is {n_loss} but the shard's loss_mask sums to {stored}",
                    )
                )
    return _capped(out)


def hidden_states_unique_sample_ids(art: Artifact) -> list[Violation]:
    rows = enumerate(_manifest(art)["sample_id"])
    return _duplicates(_where(art, "manifest"), rows, "sample_id", "sample")


def hidden_states_totals(art: Artifact) -> list[Violation]:
    m, f, out = _manifest(art), art.header.fields, []
    if f["num_samples"] != len(m["sample_id"]):
        out.append(
            Violation(
                _where(art, "dataset"),
                "header.num_samples",
                f"is {f['num_samples']} but the manifest has {len(m['sample_id'])} rows",
            )
        )
    if f["num_tokens"] != sum(m["num_tokens"]):
        out.append(
            Violation(
                _where(art, "dataset"),
                "header.num_tokens",
                f"is {f['num_tokens']} but the manifest sums to {sum(m['num_tokens'])}",
            )
        )
    return out


def hidden_states_row_checksums(art: Artifact) -> list[Violation]:
    if hidden_states_shard_paths_inside(art) or hidden_states_manifest_rows(art):
        return []  # reported there
    version = art.header.schema_version
    algorithm = checksum_algorithm(version)
    out = []
    for shard, rows in _rows_by_shard(art).items():
        st = art.safetensors(resolve_shard_path(art.root, shard))
        for row, start, n, _, checksum in rows:
            if not checksum.startswith(f"{algorithm}:"):
                message = f"{checksum[:24]}... is not a {algorithm} checksum, which schema v{version} uses"
                out.append(
                    Violation(_where(art, "manifest"), f"row {row}, column checksum", message)
                )
                continue
            stored = row_checksum(st, start, n, version)
            if stored != checksum:
                out.append(
                    Violation(
                        _where(art, "manifest"),
                        f"row {row}, column checksum",
                        f"{checksum} but the stored rows hash to {stored} (shard {shard} was changed or torn)",
                    )
                )
    return _capped(out)


STORAGE_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "fp8_e4m3": "F8_E4M3"}


def hidden_states_storage_dtype(art: Artifact) -> list[Violation]:
    storage = art.header.fields["storage_dtype"]
    want = STORAGE_DTYPES[storage]
    out = []
    for path in art.files["shards"]:
        st = art.safetensors(path)
        for name in ("aux_hidden_states", "last_hidden_state"):
            if st.tensors[name].dtype != want:
                out.append(
                    Violation(
                        art.rel(path),
                        f"tensor {name}",
                        f"dtype {st.tensors[name].dtype} but storage_dtype is {storage} ({want})",
                    )
                )
        scales = {"aux_hidden_states_scale", "last_hidden_state_scale"} & set(st.tensors)
        if storage == "fp8_e4m3" and len(scales) != 2:
            out.append(
                Violation(
                    art.rel(path),
                    "tensors *_scale",
                    "fp8 storage needs aux_hidden_states_scale and last_hidden_state_scale",
                )
            )
        if storage != "fp8_e4m3" and scales:
            out.append(
                Violation(
                    art.rel(path),
                    f"tensors {sorted(scales)}",
                    f"scales are only allowed with fp8 storage, not {storage}",
                )
            )
    return _capped(out)


def hidden_states_finite(art: Artifact) -> list[Violation]:
    out = []
    for path in art.files["shards"]:
        st = art.safetensors(path)
        for name in (
            "aux_hidden_states",
            "last_hidden_state",
            "aux_hidden_states_scale",
            "last_hidden_state_scale",
        ):
            if name in st.tensors and (
                bad := nonfinite_count(st.array(name), st.tensors[name].dtype)
            ):
                out.append(Violation(art.rel(path), f"tensor {name}", f"{bad} NaN/Inf values"))
    return out


# ---- draft_checkpoint --------------------------------------------------------------------


def draft_checkpoint_layer_ids(art: Artifact) -> list[Violation]:
    config_ids = art.json(art.root / "config.json")["eagle_aux_hidden_state_layer_ids"]
    header_ids = art.header.fields["aux_layer_ids"]
    if config_ids != header_ids:
        return [
            Violation(
                art.rel(art.root / "config.json"),
                "eagle_aux_hidden_state_layer_ids",
                f"{config_ids} but eagle3.json aux_layer_ids is {header_ids}",
            )
        ]
    return []


def _draft_vocab_sizes(art: Artifact) -> tuple[int, int]:
    """(V_draft, V_target) as config.json states them, either layout."""
    symbols = symbols_from_header(art)
    return int(symbols["V_draft"]), int(symbols["V_target"])


def _draft_vocab_map(art: Artifact) -> tuple[np.ndarray, np.ndarray]:
    """The checkpoint's (d2t, t2d): stored, or the identity of a full vocabulary that stores
    none (draft_checkpoint v3). Where d2t is missing from a pruned draft, the identity stands
    in so the other checks still run; vocab_map_tensors names the missing tensor."""
    st = art.safetensors(art.path("weights"))
    v_draft, v_target = _draft_vocab_sizes(art)
    if "d2t" not in st.tensors and stores_vocab_map(v_draft, v_target):
        t2d = np.zeros(v_target, dtype=np.bool_)
        t2d[:v_draft] = True  # what vLLM would serve: draft id i as target id i
        return np.zeros(v_draft, dtype=np.int64), t2d
    return checkpoint_vocab_map(st.tensors, st.array, v_draft, v_target)


def draft_checkpoint_d2t_offsets(art: Artifact) -> list[Violation]:
    d2t, t2d = _draft_vocab_map(art)
    return _d2t_offsets(_where(art, "weights"), d2t, len(t2d))


def draft_checkpoint_t2d_matches_d2t(art: Artifact) -> list[Violation]:
    d2t, t2d = _draft_vocab_map(art)
    return _t2d_matches(_where(art, "weights"), d2t, t2d)


def draft_checkpoint_vocab_map_fingerprint(art: Artifact) -> list[Violation]:
    stored = fingerprint_vocab_map(*_draft_vocab_map(art))
    recorded = art.header.lineage["vocab_map_fingerprint"]
    if stored != recorded:
        return [
            Violation(
                art.rel(art.path("lineage")),
                "header.lineage.vocab_map_fingerprint",
                f"{recorded} but the checkpoint's d2t/t2d fingerprint is {stored}",
            )
        ]
    return []


def draft_checkpoint_vocab_map_tensors(art: Artifact) -> list[Violation]:
    names = art.safetensors(art.path("weights")).tensors
    v_draft, v_target = _draft_vocab_sizes(art)
    where = _where(art, "weights")
    out = [
        Violation(where, f"tensor {name}", why)
        for name, why in serving_problems(names, v_draft, v_target)
    ]
    if not stores_vocab_map(v_draft, v_target) and "t2d" in names:
        out.append(
            Violation(
                where,
                "tensor t2d",
                f"stored in a full-vocabulary draft (draft_vocab_size = vocab_size = {v_target}): "
                "its map is the identity, stored by neither d2t nor t2d",
            )
        )
    elif stores_vocab_map(v_draft, v_target) and "t2d" not in names:
        out.append(Violation(where, "tensor t2d", "missing beside d2t in a pruned draft"))
    return out


VARIANT_TENSORS = {
    "llama": ("q_proj", "k_proj", "v_proj"),
    "mla": (
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
    ),
}


def draft_checkpoint_variant_tensors(art: Artifact) -> list[Violation]:
    variant = art.header.fields["architecture"]
    config = art.json(art.root / "config.json")
    where = _where(art, "weights")
    out = []
    if ("transformer_layer_config" in config) != (variant == "llama"):
        out.append(
            Violation(
                _where(art, "config"),
                "(layout)",
                f"eagle3.json architecture {variant!r} but config.json is in the other variant's layout",
            )
        )
    names = set(art.safetensors(art.path("weights")).tensors)
    for kind, parts in VARIANT_TENSORS.items():
        for part in parts:
            name = f"layers.0.self_attn.{part}.weight"
            if kind == variant and name not in names:
                message = f"missing: the {variant} attention needs it"
                out.append(Violation(where, f"tensor {name}", message))
            elif kind != variant and name in names:
                out.append(
                    Violation(where, f"tensor {name}", f"a {kind} tensor in a {variant} draft")
                )
    return out


def draft_checkpoint_finite(art: Artifact) -> list[Violation]:
    st = art.safetensors(art.path("weights"))
    return [
        Violation(art.rel(art.path("weights")), f"tensor {name}", f"{bad} NaN/Inf values")
        for name, info in st.tensors.items()
        if (bad := nonfinite_count(st.array(name), info.dtype))
    ]


# ---- eval_report -------------------------------------------------------------------------


def eval_report_acceptance_length(art: Artifact) -> list[Violation]:
    f, where, out = art.header.fields, _where(art, "report"), []
    drafts, accepted, rates = (
        f["num_drafts"],
        f["num_accepted_tokens"],
        f["per_position_acceptance"],
    )
    if len(rates) != f["num_speculative_tokens"]:
        out.append(
            Violation(
                where,
                "per_position_acceptance",
                f"has {len(rates)} entries, expected num_speculative_tokens={f['num_speculative_tokens']}",
            )
        )
    expected = 1 + accepted / drafts if drafts else 1.0
    if abs(f["acceptance_length"] - expected) > 1e-6:
        out.append(
            Violation(
                where,
                "acceptance_length",
                f"is {f['acceptance_length']} but 1 + num_accepted_tokens/num_drafts = {expected:.6f}",
            )
        )
    if drafts and abs(f["acceptance_length"] - (1 + sum(rates))) > 1e-6:
        out.append(
            Violation(
                where,
                "per_position_acceptance",
                f"sums to {sum(rates):.6f}, but acceptance_length - 1 = {f['acceptance_length'] - 1:.6f}",
            )
        )
    return out


def eval_report_sample_totals(art: Artifact) -> list[Violation]:
    f, t, where, out = art.header.fields, art.table(art.path("samples")), _where(art, "samples"), []
    if t.num_rows != f["num_prompts"]:
        out.append(
            Violation(
                where,
                "(rows)",
                f"{t.num_rows} rows but the report has num_prompts={f['num_prompts']}",
            )
        )
    for column in ("num_drafts", "num_accepted_tokens"):
        total = pc.sum(t.column(column)).as_py() or 0
        if total != f[column]:
            out.append(
                Violation(
                    where,
                    f"column {column}",
                    f"sums to {total} but the report has {column}={f[column]}",
                )
            )
    return out


def _group_figures(where: str, label: str, group: dict[str, Any], k: int) -> list[Violation]:
    drafts, accepted = group["num_drafts"], group["num_accepted_tokens"]
    expected = 1 + accepted / drafts if drafts else 1.0
    rates = group["per_position_acceptance"]
    out = []
    if len(rates) != k:
        out.append(Violation(where, label, f"{len(rates)} per-position rates for k={k}"))
    if abs(group["acceptance_length"] - expected) > 1e-6 or (
        drafts and abs(group["acceptance_length"] - 1 - sum(rates)) > 1e-6
    ):
        out.append(
            Violation(
                where,
                label,
                f"acceptance_length {group['acceptance_length']} is not 1 + {accepted}/{drafts} "
                f"= 1 + sum(per_position_acceptance)",
            )
        )
    return out


def eval_report_group_totals(art: Artifact) -> list[Violation]:
    """Each group's counts are the sums of its own sample rows; the sets cover every row."""
    f, where = art.header.fields, _where(art, "report")
    rows = art.table(art.path("samples")).select(
        ["prompt_set", "category", "num_drafts", "num_accepted_tokens"]
    )
    sums: dict[tuple[str, str | None], list[int]] = {}
    for row in rows.to_pylist():
        keys = [(row["prompt_set"], None)]  # the whole set, and its category when it has one
        if row["category"] is not None:
            keys.append((row["prompt_set"], row["category"]))
        for key in keys:
            total = sums.setdefault(key, [0, 0, 0])
            total[0] += 1
            total[1] += row["num_drafts"]
            total[2] += row["num_accepted_tokens"]
    out: list[Violation] = []
    seen = set()
    for i, group in enumerate(f["groups"]):
        key = (group["prompt_set"], group["category"])
        label = f"groups[{i}] ({key[0]}/{key[1] or '*'})"
        if key in seen:
            out.append(Violation(where, label, "appears twice"))
        seen.add(key)
        found = sums.get(key, [0, 0, 0])
        stated = [group["num_prompts"], group["num_drafts"], group["num_accepted_tokens"]]
        if stated != found:
            out.append(
                Violation(
                    where,
                    label,
                    f"prompts/drafts/accepted {stated} but its samples.parquet rows sum to {found}",
                )
            )
        out += _group_figures(where, label, group, f["num_speculative_tokens"])
    missing = sorted({s for s, _ in sums} - {s for s, c in seen if c is None})
    if missing:
        out.append(Violation(where, "groups", f"no group for prompt set(s) {missing}"))
    return out


# Checks that read every stored value; validate(deep=False) skips them.
DEEP_CHECKS = {"row_checksums", "finite"}

CHECKS: dict[str, dict[str, Check]] = {
    "conversations": {
        "unique_ids": conversations_unique_ids,
        "roles_alternate": conversations_roles_alternate,
        "tools_and_mode": conversations_tools_and_mode,
    },
    "tokenized": {
        "unique_ids": tokenized_unique_ids,
        "row_lengths": tokenized_row_lengths,
        "loss_mask_binary": tokenized_loss_mask_binary,
        "token_ids_in_vocab": tokenized_token_ids_in_vocab,
    },
    "vocab_map": {
        "d2t_offsets": vocab_map_d2t_offsets,
        "t2d_matches_d2t": vocab_map_t2d_matches_d2t,
        "counts_nonnegative": vocab_map_counts_nonnegative,
    },
    "hidden_states": {
        "layer_ids": hidden_states_layer_ids,
        "shard_paths_inside": hidden_states_shard_paths_inside,
        "manifest_rows": hidden_states_manifest_rows,
        "unique_sample_ids": hidden_states_unique_sample_ids,
        "totals": hidden_states_totals,
        "row_checksums": hidden_states_row_checksums,
        "storage_dtype": hidden_states_storage_dtype,
        "finite": hidden_states_finite,
    },
    "draft_checkpoint": {
        "layer_ids": draft_checkpoint_layer_ids,
        "d2t_offsets": draft_checkpoint_d2t_offsets,
        "variant_tensors": draft_checkpoint_variant_tensors,
        "t2d_matches_d2t": draft_checkpoint_t2d_matches_d2t,
        "vocab_map_tensors": draft_checkpoint_vocab_map_tensors,
        "vocab_map_fingerprint": draft_checkpoint_vocab_map_fingerprint,
        "finite": draft_checkpoint_finite,
    },
    "eval_report": {
        "acceptance_length": eval_report_acceptance_length,
        "sample_totals": eval_report_sample_totals,
        "group_totals": eval_report_group_totals,
    },
}
