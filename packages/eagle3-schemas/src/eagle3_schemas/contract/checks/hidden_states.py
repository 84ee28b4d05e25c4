"""Checks of the hidden-state dataset: layer ids, shard paths inside the dataset, manifest rows
that tile each shard, totals, row checksums, storage dtype, finite values.
"""

from __future__ import annotations

from typing import Any

from eagle3_schemas.contract.artifact import Artifact, Violation
from eagle3_schemas.contract.checks.common import capped, duplicates, file_name, named
from eagle3_schemas.io.safetensors_format import nonfinite_count
from eagle3_schemas.layouts.hidden_states import (
    UnsafeShardPath,
    checksum_algorithm,
    resolve_shard_path,
    row_checksum,
)


def symbols(art: Artifact) -> dict[str, int]:
    """Shape symbols fixed by the header."""
    t = art.header.fields["target"]
    return {
        "H": t["hidden_size"],
        "V_target": t["vocab_size"],
        "n_aux": len(art.header.fields["aux_layer_ids"]),
    }


def layer_ids(art: Artifact) -> list[Violation]:
    f = art.header.fields
    ids, n_layers = f["aux_layer_ids"], f["target"]["num_hidden_layers"]
    where, out = file_name(art, "dataset"), []
    if ids != sorted(set(ids)):
        message = f"{ids} must be sorted ascending without repeats"
        out.append(Violation(where, "header.aux_layer_ids", message))
    if any(not 0 <= i <= n_layers for i in ids):
        message = f"{ids} outside [0, {n_layers}] (vLLM convention: 0 = embeddings, {n_layers} = last layer before the final norm)"
        out.append(Violation(where, "header.aux_layer_ids", message))
    if art.header.lineage.get("aux_layer_ids") != ids:
        message = (
            f"{art.header.lineage.get('aux_layer_ids')} differs from header aux_layer_ids {ids}"
        )
        out.append(Violation(where, "header.lineage.aux_layer_ids", message))
    return out


def _manifest(art: Artifact) -> dict[str, list[Any]]:
    return art.table(art.path("manifest")).to_pydict()


def shard_paths_inside(art: Artifact) -> list[Violation]:
    out, where = [], file_name(art, "manifest")
    for row, shard in enumerate(_manifest(art)["shard"]):
        try:
            path = resolve_shard_path(art.root, shard)
        except UnsafeShardPath as e:
            out.append(Violation(where, f"row {row}, column shard", str(e)))
            continue
        if not path.is_file():
            out.append(Violation(where, f"row {row}, column shard", f"{shard!r} does not exist"))
    return capped(out)


def _rows_by_shard(art: Artifact) -> dict[str, list[tuple[int, int, int, int, str]]]:
    m = _manifest(art)
    grouped: dict[str, list[tuple[int, int, int, int, str]]] = {}
    columns = ("shard", "row_start", "num_tokens", "num_loss_tokens", "checksum")
    for row, (shard, start, n, n_loss, checksum) in enumerate(
        zip(*(m[c] for c in columns), strict=True)
    ):
        grouped.setdefault(shard, []).append((row, start, n, n_loss, checksum))
    return grouped


def manifest_rows(art: Artifact) -> list[Violation]:
    if shard_paths_inside(art):
        return []  # reported there
    out, where = [], file_name(art, "manifest")
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
            message = f"manifest rows {spans[:3]}... do not tile the shard's cu_seqlens {cu.tolist()[:4]}... over {total} tokens"
            out.append(Violation(where, f"shard {shard}", message))
            continue
        for row, start, n, n_loss, _ in rows:
            stored = int(loss_mask[start : start + n].sum())
            if stored != n_loss:
                message = f"is {n_loss} but the shard's loss_mask sums to {stored}"
                out.append(Violation(where, f"row {row}, column num_loss_tokens", message))
    return capped(out)


def unique_sample_ids(art: Artifact) -> list[Violation]:
    rows = enumerate(_manifest(art)["sample_id"])
    return duplicates(file_name(art, "manifest"), rows, "sample_id", "sample")


def totals(art: Artifact) -> list[Violation]:
    m, f, out, where = _manifest(art), art.header.fields, [], file_name(art, "dataset")
    if f["num_samples"] != len(m["sample_id"]):
        message = f"is {f['num_samples']} but the manifest has {len(m['sample_id'])} rows"
        out.append(Violation(where, "header.num_samples", message))
    if f["num_tokens"] != sum(m["num_tokens"]):
        message = f"is {f['num_tokens']} but the manifest sums to {sum(m['num_tokens'])}"
        out.append(Violation(where, "header.num_tokens", message))
    return out


def row_checksums(art: Artifact) -> list[Violation]:
    if shard_paths_inside(art) or manifest_rows(art):
        return []  # reported there
    version = art.header.schema_version
    algorithm = checksum_algorithm(version)
    out, where = [], file_name(art, "manifest")
    for shard, rows in _rows_by_shard(art).items():
        st = art.safetensors(resolve_shard_path(art.root, shard))
        for row, start, n, _, checksum in rows:
            if not checksum.startswith(f"{algorithm}:"):
                message = f"{checksum[:24]}... is not a {algorithm} checksum, which schema v{version} uses"
                out.append(Violation(where, f"row {row}, column checksum", message))
                continue
            stored = row_checksum(st, start, n, version)
            if stored != checksum:
                message = f"{checksum} but the stored rows hash to {stored} (shard {shard} was changed or torn)"
                out.append(Violation(where, f"row {row}, column checksum", message))
    return capped(out)


STORAGE_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "fp8_e4m3": "F8_E4M3"}


def storage_dtype(art: Artifact) -> list[Violation]:
    storage = art.header.fields["storage_dtype"]
    want = STORAGE_DTYPES[storage]
    out = []
    for path in art.files["shards"]:
        st = art.safetensors(path)
        for name in ("aux_hidden_states", "last_hidden_state"):
            if st.tensors[name].dtype != want:
                message = f"dtype {st.tensors[name].dtype} but storage_dtype is {storage} ({want})"
                out.append(Violation(art.rel(path), f"tensor {name}", message))
        scales = {"aux_hidden_states_scale", "last_hidden_state_scale"} & set(st.tensors)
        if storage == "fp8_e4m3" and len(scales) != 2:
            message = "fp8 storage needs aux_hidden_states_scale and last_hidden_state_scale"
            out.append(Violation(art.rel(path), "tensors *_scale", message))
        if storage != "fp8_e4m3" and scales:
            message = f"scales are only allowed with fp8 storage, not {storage}"
            out.append(Violation(art.rel(path), f"tensors {sorted(scales)}", message))
    return capped(out)


def finite(art: Artifact) -> list[Violation]:
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


CHECKS = named(
    layer_ids,
    shard_paths_inside,
    manifest_rows,
    unique_sample_ids,
    totals,
    row_checksums,
    storage_dtype,
    finite,
)
