"""Preflight of the inputs: each against its schema, their lineage and shapes, the stream's
budget, the draft's shape as vLLM serves it, a checkpoint to resume from, draft.init_from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_schemas.layouts.draft_vocab import VLLM_DRAFT_CLASSES, stores_vocab_map
from eagle3_train.components.checkpoint import read_run_config, read_state, run_config_path
from eagle3_train.data.inputs import RunInputs, checkpoint_lineage
from eagle3_train.export.init_from import InitFromError, compatibility_problems, read_init_draft
from eagle3_train.export.sglang import sglang_problems
from eagle3_train.model.arch import NORM_OPTIONS, DraftArch
from eagle3_train.preflight.report import Finding, error, ok, warning

# ---------------------------------------------------------------------------------------
# Inputs against their schemas


def check_schemas(inputs: RunInputs) -> list[Finding]:
    """Each input against its schema. A stream's header is checked here as a finished
    dataset's is; its shards are checked against their fragments as they are sealed."""
    from eagle3_schemas.contract.stream import check_stream_header
    from eagle3_schemas.contract.validate import validate

    out = []
    roles: list[tuple[str, Path]] = [("data.vocab_map", inputs.vocab.path)]
    if inputs.stream is None:
        roles.insert(0, ("data.hidden_states", inputs.dataset.root))
    else:
        header_problems = check_stream_header(inputs.stream.info)
        out += [Finding("error", "schema", f"data.hidden_states: {p}") for p in header_problems]
        if not header_problems:
            out += ok("schema", f"data.hidden_states: stream header {inputs.stream.root} validates")
    for role, path in roles:
        problems = validate(path)
        for p in problems[:20]:
            out += error("schema", f"{role}: {p}")
        if len(problems) > 20:
            out += error("schema", f"{role}: ... {len(problems) - 20} more")
        if not problems:
            out += ok("schema", f"{role} {path} validates")
    return out


# ---------------------------------------------------------------------------------------
# Lineage and shapes


def check_lineage(inputs: RunInputs, arch: DraftArch) -> list[Finding]:
    cfg, ds, vm = inputs.config, inputs.dataset, inputs.vocab
    ds_file = str(ds.header_file)
    ds_lineage = ds.header.get("lineage", {})
    out: list[Finding] = []

    def err(check: str, message: str) -> None:
        out.append(Finding("error", check, message))

    expected_ids = cfg.draft.aux_layer_ids
    if expected_ids is not None and expected_ids != ds.aux_layer_ids:
        err(
            "aux_layer_ids",
            f"dataset {ds_file} has aux_layer_ids {ds.aux_layer_ids} but config "
            f"draft.aux_layer_ids expects {expected_ids} (vLLM convention: id k = residual after "
            "k layers); re-extract with the expected ids or fix the config",
        )
    if ds_lineage.get("aux_layer_ids") not in (None, ds.aux_layer_ids):
        err(
            "aux_layer_ids",
            f"{ds_file}: header aux_layer_ids {ds.aux_layer_ids} but lineage.aux_layer_ids "
            f"{ds_lineage.get('aux_layer_ids')}",
        )
    n_layers = int(ds.header["target"]["num_hidden_layers"])
    bad = [i for i in ds.aux_layer_ids if not 0 <= i <= n_layers]
    if bad:
        err(
            "aux_layer_ids",
            f"{ds_file}: ids {bad} outside [0, {n_layers}] (target num_hidden_layers)",
        )
    if arch.mla and 0 in ds.aux_layer_ids:
        err(
            "aux_layer_ids",
            f"{ds_file}: aux_layer_ids {ds.aux_layer_ids} include 0 (the embedding output) for "
            "the MLA draft, whose config.json states its ids for SGLang too (eagle_config, "
            "SGLang's counting = vLLM's - 1, where 0 has no id); the export would refuse it: "
            "re-extract with ids >= 1",
        )
    for key, what in (
        ("tokenizer_fingerprint", "the vocab map was counted with another tokenizer"),
        ("tokenized_fingerprint", "the vocab map was counted over another tokenized dataset"),
    ):
        a, b = vm.lineage.get(key), ds_lineage.get(key)
        if a != b:
            err(
                "vocab_map",
                f"lineage {key}: vocab map {vm.path} has {a!r} but hidden-state dataset "
                f"{ds_file} has {b!r} ({what}: a foreign vocab map)",
            )
    if vm.t2d.shape[0] != ds.vocab_size:
        err(
            "vocab_map",
            f"vocab map {vm.path} t2d covers {vm.t2d.shape[0]} target ids but dataset "
            f"{ds_file} target.vocab_size is {ds.vocab_size}",
        )
    elif int(vm.target_ids.max(initial=0)) >= ds.vocab_size:
        err("vocab_map", f"vocab map {vm.path}: d2t maps past target vocab {ds.vocab_size}")

    tc = inputs.target_config
    if tc is not None:
        where = str(inputs.target_config_path)
        for key, theirs in (
            ("hidden_size", ds.hidden_size),
            ("num_hidden_layers", n_layers),
            ("vocab_size", ds.vocab_size),
        ):
            if key in tc and int(tc[key]) != int(theirs):
                err(
                    "target",
                    f"{key}: target config {where} has {tc[key]} but dataset {ds_file} "
                    f"target.{key} has {theirs}",
                )
        out += _check_target_files(inputs)
    elif cfg.target.name_or_path is None:
        out += warning(
            "target",
            "neither target.path nor target.name_or_path is set: the export's "
            "speculators_config.verifier.name_or_path will be null, so `vllm serve <draft>` "
            "cannot find the target (serving the target with --speculative-config still "
            "works); set target.name_or_path to the target's hub id or path",
        )
    if not any(f.level == "error" for f in out):
        out += ok(
            "lineage",
            f"aux_layer_ids {ds.aux_layer_ids}, hidden {ds.hidden_size}, V_target "
            f"{ds.vocab_size}, V_draft {vm.draft_vocab_size}, tokenizer and tokenized set agree "
            f"(vocab map {vm.fingerprint[:19]}…); target norm eps {arch.target_rms_norm_eps}",
        )
    return out


def _check_target_files(inputs: RunInputs) -> list[Finding]:
    """Fingerprints of the target directory against the dataset's lineage, where present."""
    from eagle3_schemas.contract.lineage import (
        TOKENIZER_FILES,
        fingerprint_model_dir,
        fingerprint_tokenizer_dir,
    )

    root = Path(inputs.config.target.path or ".")
    ds_lineage = inputs.dataset.header.get("lineage", {})
    out = []
    if list(root.glob("*.safetensors")):
        mine = fingerprint_model_dir(root)
        if mine != ds_lineage.get("target_fingerprint"):
            out += error(
                "target",
                f"target_fingerprint: target.path {root} is {mine} but dataset "
                f"{inputs.dataset.header_file} lineage has "
                f"{ds_lineage.get('target_fingerprint')!r} (states of another target)",
            )
    if any((root / n).is_file() for n in TOKENIZER_FILES):
        mine = fingerprint_tokenizer_dir(root)
        if mine != ds_lineage.get("tokenizer_fingerprint"):
            out += error(
                "target",
                f"tokenizer_fingerprint: target.path {root} tokenizer is {mine} but dataset "
                f"lineage has {ds_lineage.get('tokenizer_fingerprint')!r}",
            )
    return out


# What vLLM's MLA attention serves: the latent + rope width its kernels take (CPU_MLA and
# FlashMLA: 576, DeepSeek-V3's and Kimi-K2.5's 512 + 64).
MLA_HEAD_SIZE = 576


def check_stream(inputs: RunInputs) -> list[Finding]:
    """A stream's disk budget against what this run keeps on disk at once: the window being
    trained, window 0 (validation) kept to the end, and the next window to train without
    waiting. Below the first two the producer and the trainer wait for each other forever."""
    stream, d, epochs = inputs.stream, inputs.config.data, inputs.config.train.epochs
    if stream is None:
        return []
    info, budget = stream.info, stream.info.disk_budget_bytes
    if info.epochs > 1 and info.epochs != epochs:
        return error(
            "stream",
            f"the stream is extracted once for each of {info.epochs} epochs "
            f"(eagle3-extract --epochs) but train.epochs is {epochs}",
        )
    if d.reclaim and epochs > 1 and info.epochs == 1:
        return error(
            "stream",
            f"data.reclaim with train.epochs={epochs}: epoch 2 needs shards epoch 1 "
            "reclaimed. Extract once per epoch (eagle3-extract run --stream --epochs "
            f"{epochs}), or pass over each window several times (data.window_passes) "
            "with train.epochs 1, or keep every shard (no --reclaim)",
        )
    if budget is None:
        return []
    sizes = [stream.planned_bytes(k) for k in stream.windows(0)]
    if not sizes:
        return []
    largest = max(sizes)
    kept = sizes[0] if d.validation_fraction > 0 else 0
    where = f"the stream's --disk-budget ({budget} bytes)"
    if not d.reclaim:
        total = sum(info.planned_bytes(s) for s in info.plan)  # every pass stays on disk
        if total > budget:
            return error(
                "stream",
                f"{where} is smaller than the whole stream ({total} bytes planned) and "
                "data.reclaim is off: the producer would pause forever. Pass --reclaim",
            )
        return ok("stream", f"{where} holds the whole stream ({total} bytes planned)")
    if kept + largest > budget:
        return error(
            "stream",
            f"{where} cannot hold window 0 (kept for validation, {kept} bytes) and the "
            f"largest window ({largest} bytes, data.window_shards={d.window_shards}) at "
            "once: producer and trainer would wait for each other. Lower window_shards or "
            "raise the budget",
        )
    if kept + 2 * largest > budget:
        return warning(
            "stream",
            f"{where} holds window 0 and one window ({kept + largest} bytes) but not the "
            "next one as well: the trainer waits for the producer at every window",
        )
    return ok("stream", f"{where} holds window 0, the window in training and the next one")


def check_draft_shape(arch: DraftArch) -> list[Finding]:
    """Shapes vLLM would refuse at load or serving time, refused before training."""
    if not arch.mla:
        return []
    problems = []
    if not arch.q_lora_rank:
        problems.append(
            "draft.q_lora_rank is unset: vLLM 0.32's MLA draft loader renames kv_a_proj_with_mqa "
            "into a fused q_a/kv_a projection that exists only with a q_lora_rank"
        )
    head = arch.kv_lora_rank + arch.qk_rope_head_dim
    if head != MLA_HEAD_SIZE:
        problems.append(
            f"kv_lora_rank + qk_rope_head_dim = {arch.kv_lora_rank} + {arch.qk_rope_head_dim} = "
            f"{head}: vLLM's MLA backends (CPU_MLA, FlashMLA) take {MLA_HEAD_SIZE} (512 + 64, "
            "the target's latent format, so the draft shares its KV-cache layout)"
        )
    if arch.hidden_act != "silu":
        problems.append(f"hidden_act {arch.hidden_act!r}: vLLM's MLA draft MLP is SiLU only")
    if arch.num_layers != 1:
        problems.append(f"num_layers {arch.num_layers}: vLLM's EAGLE-3 MLA draft is one layer")
    if problems:
        return [Finding("error", "draft shape", p) for p in problems]
    return ok(
        "draft shape",
        f"MLA: {arch.num_attention_heads} heads, q_lora {arch.q_lora_rank}, latent "
        f"{arch.kv_lora_rank} + rope {arch.qk_rope_head_dim}, nope {arch.qk_nope_head_dim}, "
        f"v {arch.v_head_dim}",
    )


def check_resume(inputs: RunInputs, resume_from: Path | None) -> list[Finding]:
    if resume_from is None:
        return []
    state = read_state(resume_from)
    saved = state.get("lineage") or {}
    now = checkpoint_lineage(inputs)
    out = []
    for key in ("hidden_states_fingerprint", "vocab_map_fingerprint", "aux_layer_ids"):
        if key in saved and saved[key] != now[key]:
            out += error(
                "resume",
                f"{key}: checkpoint {resume_from} was trained with {saved[key]!r} but this "
                f"run's inputs give {now[key]!r} (set train.resume=never to start afresh)",
            )
    run_yaml, run_config = run_config_path(resume_from), read_run_config(resume_from)
    if run_config is not None:
        old = run_config.get("draft", {})
        for key in ("num_layers", *NORM_OPTIONS):
            if key in old and old[key] != getattr(inputs.config.draft, key):
                out += error(
                    "resume",
                    f"draft.{key}: {run_yaml} has {old[key]!r} but this config has "
                    f"{getattr(inputs.config.draft, key)!r}",
                )
    return out or ok("resume", f"checkpoint {resume_from} matches the inputs")


def check_export_format(inputs: RunInputs, arch: DraftArch) -> list[Finding]:
    """export.format sglang / both: SGLang's LlamaForCausalLMEagle3 serves this draft as
    trained (export/sglang.py), before any step."""
    if inputs.config.export.format == "speculators":
        return []
    norms = {k: getattr(arch, k) for k in NORM_OPTIONS}
    ids = list(inputs.aux_layer_ids)
    problems = sglang_problems(arch.architecture, arch.num_layers, ids, norms)
    if problems:
        return [
            Finding("error", "export_format", f"export.format {inputs.config.export.format}: {p}")
            for p in problems
        ]
    return ok("export_format", f"export.format {inputs.config.export.format}: SGLang can load it")


def check_export_vocab(arch: DraftArch) -> list[Finding]:
    """The vocabulary map the export will store, by the rule vLLM loads
    (eagle3_schemas.layouts.draft_vocab): d2t and t2d for a pruned vocabulary, none for a full one."""
    v_draft, v_target = arch.draft_vocab_size, arch.target_vocab_size
    if stores_vocab_map(v_draft, v_target):
        return ok(
            "export_vocab",
            f"V_draft {v_draft} < V_target {v_target}: the export stores d2t (vLLM's "
            "draft_id_to_target_id) and t2d",
        )
    return ok(
        "export_vocab",
        f"full vocabulary (V_draft = V_target = {v_target}): the export stores no d2t and no "
        f"t2d; {VLLM_DRAFT_CLASSES} create draft_id_to_target_id only for a pruned vocabulary "
        "and refuse to load a d2t otherwise",
    )


def check_init_from(inputs: RunInputs, arch: DraftArch) -> list[Finding]:
    """draft.init_from: the starting draft fits this run (architecture, hidden size, aux layer
    ids, target vocabulary, draft vocabulary unless remap_vocab), before any step."""
    d = inputs.config.draft
    if not d.init_from:
        return []
    try:
        init = read_init_draft(d.init_from)
    except (InitFromError, OSError, KeyError, ValueError) as e:
        return error("init_from", str(e))
    where = str(inputs.dataset.header_file)
    problems = compatibility_problems(
        init, arch, inputs.aux_layer_ids, inputs.vocab.d2t, d.remap_vocab, where
    )
    if problems:
        return [Finding("error", "init_from", p) for p in problems]
    shared = len(np.intersect1d(init.target_ids, inputs.vocab.target_ids))
    notes = [Finding("warning", "init_from", note) for note in init.notes]
    return notes + ok(
        "init_from",
        f"{d.init_from}: {init.architecture} draft ({init.layout_note}) fits; its LM head holds "
        f"{shared} of this run's {len(inputs.vocab.target_ids)} draft tokens",
    )
