"""draft.init_from: a run starts from an exported draft exactly where it left off; a draft that
does not fit is refused before any step naming both sides; a foreign draft vocabulary is
refused, or remapped row by row when asked, with the rows carried counted."""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from eagle3_train.components.build import build_model
from eagle3_train.config.run_config import load_config
from eagle3_train.data.inputs import load_inputs, resolve_arch
from eagle3_train.export.init_from import fingerprint_init_draft

from support.train import make_inputs, validation_losses, write_config, write_vocab_map


@pytest.fixture
def run_a(tmp_path, in_process):
    """Run A: trained a few steps, validated, exported in float32 (the drafts's exact weights)."""
    inputs = make_inputs(tmp_path / "inputs", num_samples=40)
    config = write_config(
        inputs,
        tmp_path / "a",
        train={"max_steps": 6, "save_every": 0, "warmup_steps": 1},
        data={"validation_fraction": 0.2},
    )
    assert in_process(["--config", str(config)]) == 0
    return inputs, tmp_path / "a" / "draft"


def test_run_b_starts_where_run_a_ended(run_a, tmp_path, in_process, caplog):
    inputs, draft_a = run_a
    recorded = json.loads((draft_a / "eagle3.json").read_text())["training"]["metrics"]
    config_b = write_config(
        inputs,
        tmp_path / "b",
        draft={"aux_layer_ids": [1, 2, 3], "attention_chunk": 64, "init_from": str(draft_a)},
        train={"max_steps": 2, "save_every": 0, "warmup_steps": 1},
        data={"validation_fraction": 0.2},
    )
    loaded, fresh = validation_losses(config_b)
    # the same validation batches through A's exported weights loaded into B's fresh model
    assert loaded == pytest.approx(recorded["val/loss"], rel=1e-5, abs=1e-6)
    assert fresh > loaded + 0.1, (fresh, loaded)  # the start is not a fresh one by accident

    with caplog.at_level(logging.INFO, logger="eagle3_train"):
        assert in_process(["--config", str(config_b)]) == 0
    assert "24 rows carried over, 0 from the target's rows" in caplog.text
    lineage = json.loads((tmp_path / "b" / "draft" / "eagle3.json").read_text())["lineage"]
    assert lineage["init_from_fingerprint"] == fingerprint_init_draft(draft_a)
    card = (tmp_path / "b" / "draft" / "README.md").read_text()
    assert f"continued from the draft `{lineage['init_from_fingerprint']}`" in card


def test_a_draft_fed_other_layers_is_refused_naming_both(run_a, tmp_path, in_process, caplog):
    _, draft_a = run_a
    other = make_inputs(tmp_path / "other", num_samples=16, aux_layer_ids=(1, 2, 4))
    config = write_config(
        other,
        tmp_path / "c",
        draft={"aux_layer_ids": None, "attention_chunk": 64, "init_from": str(draft_a)},
    )
    with caplog.at_level(logging.ERROR, logger="eagle3_train"):
        assert in_process(["--config", str(config)]) == 2
    assert f"draft.init_from {draft_a} was fed layers [1, 2, 3]" in caplog.text
    assert "holds [1, 2, 4]" in caplog.text
    assert not (tmp_path / "c" / "checkpoints").exists()


def test_a_foreign_vocabulary_is_refused_or_remapped_with_counts(
    run_a, tmp_path, in_process, caplog
):
    inputs, draft_a = run_a
    # the same data counted into a 32-token draft vocabulary (A has 24)
    vocab32 = write_vocab_map(tmp_path / "vocab32.safetensors", 64, 32)
    sections = {
        "draft": {"aux_layer_ids": [1, 2, 3], "attention_chunk": 64, "init_from": str(draft_a)},
        "data": {"vocab_map": str(vocab32), "validation_fraction": 0.1},
        "train": {"max_steps": 1, "save_every": 0, "warmup_steps": 1},
    }
    refused = write_config(inputs, tmp_path / "refused", **sections)
    with caplog.at_level(logging.ERROR, logger="eagle3_train"):
        assert in_process(["--config", str(refused)]) == 2
    assert "has 24 tokens with another d2t than this run's vocabulary map (32 tokens" in caplog.text
    assert "draft.remap_vocab: true" in caplog.text

    sections["draft"]["remap_vocab"] = True
    remapped = write_config(inputs, tmp_path / "remapped", **sections)
    config = load_config(remapped)
    run = load_inputs(config)
    model = build_model(run, resolve_arch(run), seed=0)
    a = load_file(str(draft_a / "model.safetensors"))
    a_ids = np.arange(24) + a["d2t"].numpy()
    b_ids = run.vocab.target_ids
    shared = np.intersect1d(a_ids, b_ids)
    assert 0 < len(shared) < 32
    head = load_file(str(inputs.hidden_states / "target_head.safetensors"))["lm_head.weight"]
    for i, t in enumerate(b_ids.tolist()):
        row = model.lm_head.weight[i]
        if t in a_ids:  # carried: A's trained row of that target token
            torch.testing.assert_close(row, a["lm_head.weight"][a_ids.tolist().index(t)])
        else:  # the target's own row, the usual start
            torch.testing.assert_close(row, head[t].float())
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "norm.weight"):
        torch.testing.assert_close(dict(model.named_parameters())[name], a[name], rtol=0, atol=0)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eagle3_train"):
        assert in_process(["--config", str(remapped)]) == 0
    carried = f"{len(shared)} rows carried over, {32 - len(shared)} from the target's rows"
    assert carried in caplog.text


def test_the_mla_layout_reads_loads_and_is_told_from_a_llama_run(tmp_path):
    """vLLM-native MLA drafts (Kimi-K2.5's published layout) read and load as exported."""
    from eagle3_schemas.contract.header import write_safetensors
    from eagle3_schemas.io.atomic import write_json_atomic
    from eagle3_train.export.init_from import compatibility_problems, load_into, read_init_draft
    from eagle3_train.export.write import draft_config, export_weights
    from eagle3_train.model.draft import Eagle3Draft

    from support.train import vocab_arrays, yarn_arch

    arch = dataclasses.replace(yarn_arch("mla"), fc_norm=True)  # EAGLE 3.1's per-aux norms
    _, d2t, t2d = vocab_arrays(arch.target_vocab_size, arch.draft_vocab_size)
    torch.manual_seed(1)
    source = Eagle3Draft(arch)
    with torch.no_grad():  # away from the ones a fresh draft starts with
        for norm in source.fc_norm:
            norm.weight.uniform_(0.5, 1.5)
    directory = tmp_path / "mla"
    directory.mkdir()
    write_json_atomic(directory / "config.json", draft_config(arch, [2, 30, 58], None, [], 3))
    write_safetensors(
        directory / "model.safetensors",
        export_weights(source.state_dict(), d2t, t2d, "bfloat16"),
    )
    init = read_init_draft(directory)
    assert (init.architecture, init.hidden_size, init.aux_layer_ids) == ("mla", 64, [2, 30, 58])
    assert compatibility_problems(init, arch, [2, 30, 58], d2t, False, "here") == []
    llama = yarn_arch("llama")
    assert compatibility_problems(init, llama, [2, 30, 58], d2t, False, "here") == [
        f"architecture: draft.init_from {directory} has mla, this run (here) has llama",
        f"fc_norm: draft.init_from {directory} has True, this run (here) has False",
    ]
    torch.manual_seed(2)
    target = Eagle3Draft(arch)
    counts = load_into(target, init, d2t)
    assert counts["lm_head_rows_carried"] == arch.draft_vocab_size
    for name, p in source.named_parameters():  # bf16 export: equal to bf16 rounding
        torch.testing.assert_close(
            dict(target.named_parameters())[name], p.detach().to(torch.bfloat16).float()
        )


@pytest.mark.parametrize("architecture", ["llama", "mla"])
def test_a_full_vocabulary_draft_starts_a_run_with_or_without_the_legacy_d2t(
    tmp_path, architecture
):
    """A full-vocabulary draft stores no d2t (as the public Kimi-K2.5 drafts): its map is the
    identity, and it starts a run. One written before that rule, holding the d2t vLLM refuses,
    still starts it, with a note naming the tensor and the engine."""
    from eagle3_schemas.contract.header import write_safetensors
    from eagle3_schemas.io.atomic import write_json_atomic
    from eagle3_train.export.init_from import compatibility_problems, load_into, read_init_draft
    from eagle3_train.export.write import draft_config, export_weights
    from eagle3_train.model.draft import Eagle3Draft

    from support.train import yarn_arch

    full = yarn_arch(architecture)
    arch = dataclasses.replace(full, draft_vocab_size=full.target_vocab_size)
    d2t = np.zeros(arch.target_vocab_size, dtype=np.int64)
    t2d = np.ones(arch.target_vocab_size, dtype=bool)
    torch.manual_seed(3)
    source = Eagle3Draft(arch)
    weights = export_weights(source.state_dict(), d2t, t2d, "float32")
    assert "d2t" not in weights and "t2d" not in weights
    for name, extra in (("as-exported", {}), ("legacy", {"d2t": torch.from_numpy(d2t)})):
        directory = tmp_path / name
        directory.mkdir()
        write_json_atomic(directory / "config.json", draft_config(arch, [2, 30, 58], None, [], 3))
        write_safetensors(directory / "model.safetensors", {**weights, **extra})
        init = read_init_draft(directory)
        np.testing.assert_array_equal(init.d2t, d2t)
        assert init.draft_vocab_size == arch.target_vocab_size
        assert compatibility_problems(init, arch, [2, 30, 58], d2t, False, "here") == []
        if extra:
            assert len(init.notes) == 1 and "tensor d2t" in init.notes[0]
            assert "vLLM's Eagle3LlamaForCausalLM" in init.notes[0]
        else:
            assert init.notes == ()
        target = Eagle3Draft(arch)
        counts = load_into(target, init, d2t)
        assert counts["lm_head_rows_carried"] == arch.target_vocab_size
        torch.testing.assert_close(target.lm_head.weight, source.lm_head.weight, rtol=0, atol=0)


def test_a_pruned_draft_without_d2t_is_refused(tmp_path):
    from eagle3_schemas.contract.header import write_safetensors
    from eagle3_schemas.io.atomic import write_json_atomic
    from eagle3_train.export.init_from import InitFromError, read_init_draft
    from eagle3_train.export.write import draft_config, export_weights
    from eagle3_train.model.draft import Eagle3Draft

    from support.train import vocab_arrays, yarn_arch

    arch = yarn_arch("llama")
    _, d2t, t2d = vocab_arrays(arch.target_vocab_size, arch.draft_vocab_size)
    weights = export_weights(Eagle3Draft(arch).state_dict(), d2t, t2d, "float32")
    del weights["d2t"]
    tmp_path.joinpath("d").mkdir()
    write_json_atomic(tmp_path / "d" / "config.json", draft_config(arch, [2, 30, 58], None, [], 3))
    write_safetensors(tmp_path / "d" / "model.safetensors", weights)
    with pytest.raises(InitFromError, match="stores no d2t"):
        read_init_draft(tmp_path / "d")
