"""Preflight refuses mismatched inputs in seconds, naming both sides."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest
import yaml

from eagle3_schemas.contract.validate import validate
from eagle3_schemas.io.safetensors_format import read_safetensors
from eagle3_train.components import zero_clip
from eagle3_train.components.accelerator import DEEPSPEED_REFUSED, ZeroLaunch
from eagle3_train.components.checkpoint import Checkpoints
from eagle3_train.config.run_config import load_config
from eagle3_train.data.inputs import load_inputs, resolve_arch
from eagle3_train.preflight import run_preflight
from eagle3_train.preflight.artifacts import check_lineage
from eagle3_train.preflight.environment import check_interfaces

from support.synthetic_states import fake_fingerprint
from support.train import (
    make_inputs,
    run_cli,
    small_arch,
    train_in_process,
    write_config,
    write_vocab_map_from_counts,
)


def _errors(inputs, tmp_path, **sections):
    config = load_config(write_config(inputs, tmp_path / "run", **sections))
    run = load_inputs(config)
    report = run_preflight(run, resolve_arch(run), None, None, full=True)
    return [str(f) for f in report.errors], report


def test_clean_inputs_pass_every_check_and_run_one_batch(inputs, tmp_path):
    errors, report = _errors(inputs, tmp_path)
    assert errors == []
    checks = {f.check for f in report.findings if f.level == "ok"}
    assert {"schema", "lineage", "interfaces", "dry_run", "memory"} <= checks


def test_wrong_layer_ids_dataset_is_refused(tmp_path):
    wrong = make_inputs(tmp_path / "wrong", aux_layer_ids=(0, 2, 4))
    errors, _ = _errors(wrong, tmp_path)  # config expects [1, 2, 3]
    assert len(errors) == 1, errors
    assert "dataset.json has aux_layer_ids [0, 2, 4]" in errors[0]
    assert "draft.aux_layer_ids expects [1, 2, 3]" in errors[0]


def test_an_mla_draft_on_the_embedding_output_is_refused_before_training(tmp_path):
    """The MLA export states the aux ids for SGLang too (SGLang's id = vLLM's - 1), where
    vLLM's id 0 has none: the export would refuse it, so preflight does, before any step."""
    inputs = make_inputs(tmp_path / "zero", aux_layer_ids=(0, 2, 3))
    config = load_config(write_config(inputs, tmp_path / "run", draft={"aux_layer_ids": [0, 2, 3]}))
    run = load_inputs(config)
    arch = resolve_arch(run)
    assert [str(f) for f in check_lineage(run, arch) if f.level == "error"] == []
    errors = [
        str(f) for f in check_lineage(run, replace(arch, architecture="mla")) if f.level == "error"
    ]
    assert len(errors) == 1 and "include 0" in errors[0] and "SGLang" in errors[0], errors


def test_foreign_vocab_map_is_refused(tmp_path):
    foreign = make_inputs(tmp_path / "foreign", vocab_label="other-tokenizer")
    errors, _ = _errors(foreign, tmp_path)
    joined = "\n".join(errors)
    assert "lineage tokenizer_fingerprint: vocab map" in joined
    assert str(foreign.vocab_map) in joined and "dataset.json" in joined
    assert "foreign vocab map" in joined


def test_vocab_map_of_another_tokenized_dataset_with_the_same_tokenizer_is_refused(
    inputs, tmp_path
):
    """Only the tokenized-dataset lineage differs: same tokenizer, same counts, same shapes.

    A vocab map counted over another tokenized set (say, before the answers were regenerated)
    passes every shape check; the lineage comparison is the only thing that can refuse it.
    """
    ds_lineage = json.loads((inputs.hidden_states / "dataset.json").read_text())["lineage"]
    vm = read_safetensors(inputs.vocab_map)
    counts = vm.array("token_counts")
    other_set = fake_fingerprint("another-tokenized-dataset/tokenized")
    write_vocab_map_from_counts(
        inputs.vocab_map,
        counts,
        vm.tensors["d2t"].shape[0],
        {
            "tokenizer_fingerprint": ds_lineage["tokenizer_fingerprint"],
            "tokenized_fingerprint": other_set,
        },
    )
    errors, _ = _errors(inputs, tmp_path)
    assert len(errors) == 1, errors
    assert "lineage tokenized_fingerprint: vocab map" in errors[0]
    assert f"{other_set!r}" in errors[0] and f"{ds_lineage['tokenized_fingerprint']!r}" in errors[0]
    assert str(inputs.vocab_map) in errors[0] and "dataset.json" in errors[0]
    assert "the vocab map was counted over another tokenized dataset" in errors[0]


def test_mismatched_hidden_size_is_refused(tmp_path):
    mismatched = make_inputs(tmp_path / "h", hidden=16, target_hidden=32)
    errors, _ = _errors(mismatched, tmp_path)
    assert any(
        "hidden_size: target config" in e and "has 32" in e and "target.hidden_size has 16" in e
        for e in errors
    ), errors


@pytest.mark.process
def test_cli_preflight_stops_in_seconds_with_both_sides(tmp_path):
    wrong = make_inputs(tmp_path / "wrong", aux_layer_ids=(0, 2, 4))
    config = write_config(wrong, tmp_path / "run")
    start = time.perf_counter()
    result = run_cli(["--config", str(config), "--preflight"])
    elapsed = time.perf_counter() - start
    assert result.returncode == 2, result.stderr[-2000:]
    assert "[0, 2, 4]" in result.stderr and "[1, 2, 3]" in result.stderr
    assert elapsed < 60  # process start-up included; the checks themselves take < 1 s
    assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"train": {"lrr": 1}}, "unknown key(s) lrr"),
        ({"train": {"ttt_steps": "three"}}, "train.ttt_steps: expected an integer, found 'three'"),
        ({"draft": {"attention": "triton"}}, "draft.attention: 'triton' is not one of"),
        ({"export": {"speculative_tokens": 0}}, "export.speculative_tokens: 0 < 1"),
    ],
)
def test_config_errors_name_the_key(inputs, tmp_path, override, message):
    from eagle3_train.config.run_config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(write_config(inputs, tmp_path / "run", **override))
    assert message in str(e.value)


def test_cli_overrides_win_over_the_file(inputs, tmp_path):
    from eagle3_train.config.run_config import parse_override

    path = write_config(inputs, tmp_path / "run", train={"lr": 0.1})
    config = load_config(
        path, [parse_override("train.lr=3e-4"), parse_override("draft.num_layers=2")]
    )
    assert config.train.lr == 3e-4 and config.draft.num_layers == 2
    assert config.train.ttt_steps == 3  # defaults below the file


def test_mixed_precision_no_is_the_word_no_in_yaml_and_in_set(inputs, tmp_path):
    """YAML 1.1 (PyYAML) reads a bare `no` as False; a choice the user typed is meant."""
    from eagle3_train.config.run_config import ConfigError, dump_config, parse_override

    path = write_config(inputs, tmp_path / "run")
    text = path.read_text()
    assert "\ntrain:\n" in text
    bare = tmp_path / "bare-no.yaml"
    bare.write_text(text.replace("\ntrain:\n", "\ntrain:\n  mixed_precision: no\n", 1))
    assert yaml.safe_load(bare.read_text())["train"]["mixed_precision"] is False
    from_yaml = load_config(bare)
    assert from_yaml.train.mixed_precision == "no"
    from_set = load_config(path, [parse_override("train.mixed_precision=no")])
    assert from_set.train.mixed_precision == "no"
    saved = tmp_path / "saved.yaml"  # run.yaml as the trainer writes it reads back the same
    saved.write_text(dump_config(from_set))
    assert load_config(saved).train.mixed_precision == "no"
    # a boolean that is none of the choices is still refused, naming the key
    with pytest.raises(ConfigError, match=r"train\.on_non_finite: False is not one of"):
        load_config(path, [parse_override("train.on_non_finite=no")])


# ---------------------------------------------------------------------------------------
# Derive, don't repeat (issue 14, item 4): the dataset records its aux ids, target sizes and
# norm eps; the YAML need not restate them (and target.path is optional).

DRAFT_SHAPE = {
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 4096,
}


def _without(path, *keys):
    """Drop ``section.key`` (or a whole ``section``) from the YAML file at ``path``."""
    import yaml

    cfg = yaml.safe_load(path.read_text())
    for key in keys:
        section, _, name = key.partition(".")
        if name:
            del cfg[section][name]
        else:
            del cfg[section]
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_aux_ids_are_taken_from_the_dataset_when_the_config_omits_them(tmp_path):
    other = make_inputs(tmp_path / "other", aux_layer_ids=(0, 2, 4))
    config = load_config(_without(write_config(other, tmp_path / "run"), "draft.aux_layer_ids"))
    assert config.draft.aux_layer_ids is None
    run = load_inputs(config)
    report = run_preflight(run, resolve_arch(run), None, None, full=True)
    assert [str(f) for f in report.errors] == []
    assert any(f.check == "dry_run" and f.level == "ok" for f in report.findings)
    assert run.aux_layer_ids == [0, 2, 4]


def test_a_run_without_target_path_or_aux_ids_trains_and_exports_the_datasets_ids(tmp_path):
    """No target section at all, no draft.aux_layer_ids: the dataset ([0, 2, 4], eps,
    architecture, sizes) and the draft section are enough; the export serves those ids."""

    other = make_inputs(tmp_path / "other", aux_layer_ids=(0, 2, 4))
    path = write_config(
        other, tmp_path / "run", draft=DRAFT_SHAPE, train={"max_steps": 2, "save_every": 0}
    )
    path = _without(path, "target", "draft.aux_layer_ids")
    assert train_in_process(["--config", str(path), "--set", "target.name_or_path=org/target"]) == 0
    exported = json.loads((tmp_path / "run" / "draft" / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    verifier = exported["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}
    layer = exported["transformer_layer_config"]
    assert (layer["num_attention_heads"], layer["num_key_value_heads"]) == (4, 2)
    assert (layer["intermediate_size"], layer["rms_norm_eps"]) == (32, 1e-6)  # eps: dataset.json


def test_without_target_path_the_missing_draft_shape_is_named(inputs, tmp_path):
    from eagle3_train.data.inputs import InputError

    config = load_config(_without(write_config(inputs, tmp_path / "run"), "target"))
    with pytest.raises(InputError) as e:
        resolve_arch(load_inputs(config))
    message = str(e.value)
    for key in ("num_attention_heads", "intermediate_size", "max_position_embeddings"):
        assert f"draft.{key}" in message
    assert "target.path" in message and "dataset.json" in message


def test_the_draft_shape_comes_from_dataset_json_where_extract_recorded_it(inputs, tmp_path):
    header_path = inputs.hidden_states / "dataset.json"
    header = json.loads(header_path.read_text())
    header["target"].update(DRAFT_SHAPE, rope_theta=500000.0)
    header_path.write_text(json.dumps(header))
    assert validate(inputs.hidden_states) == []  # extra target keys are within schema v1
    config = load_config(_without(write_config(inputs, tmp_path / "run"), "target"))
    run = load_inputs(config)
    arch = resolve_arch(run)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (4, 2, 4)
    assert (arch.intermediate_size, arch.rope_theta) == (32, 500000.0)
    findings = run_preflight(run, arch, None, None, full=False).findings
    assert not [f for f in findings if f.level == "error"]
    # nothing names the target for `vllm serve <draft>`: said before the run, not after
    assert any(f.level == "warning" and "target.name_or_path" in f.message for f in findings)


def test_a_stated_aux_id_contradiction_is_refused_without_target_path(tmp_path):
    other = make_inputs(tmp_path / "other", aux_layer_ids=(0, 2, 4))
    path = _without(write_config(other, tmp_path / "run", draft=DRAFT_SHAPE), "target")
    run = load_inputs(load_config(path))  # the config states [1, 2, 3]
    errors = [str(f) for f in run_preflight(run, resolve_arch(run), None, None).errors]
    assert len(errors) == 1, errors
    assert f"dataset {other.hidden_states}/dataset.json has aux_layer_ids [0, 2, 4]" in errors[0]
    assert "config draft.aux_layer_ids expects [1, 2, 3]" in errors[0]


def test_a_resume_that_does_not_match_its_checkpoint_is_refused_naming_both(
    inputs, tmp_path, in_process
):
    """Preflight asks the checkpoints what a resume must match: the checkpoint's lineage
    (its trainer_state.json) and the draft of the run that wrote it (that run's run.yaml)."""
    out = tmp_path / "run"
    assert in_process(["--config", str(write_config(inputs, out, train={"max_steps": 4}))]) == 0
    checkpoint = Checkpoints(out, keep=1).find("auto")
    assert checkpoint == out / "checkpoints" / "step-00000004"
    other = make_inputs(tmp_path / "other", seed=1)
    run = load_inputs(load_config(write_config(other, out, draft={"num_layers": 2})))
    report = run_preflight(run, resolve_arch(run), None, checkpoint, full=False)
    errors = [str(f) for f in report.errors]
    assert len(errors) == 2, errors
    assert f"hidden_states_fingerprint: checkpoint {checkpoint} was trained with" in errors[0]
    assert f"draft.num_layers: {out / 'run.yaml'} has 1 but this config has 2" in errors[1]


# every setting DeepSpeed cannot run, as a user writes it: (train section, launch environment)
MUON = {"optimizer": "muon", "max_grad_norm": 0}
DEEPSPEED_REFUSED_CASES = {
    "train.on_non_finite: skip": ({"on_non_finite": "skip"}, {}),
    "train.optimizer: muon under ZeRO stage 1 or 3": (
        MUON,
        {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
    ),
    "train.optimizer: muon with offload_optimizer": (
        MUON,
        {"ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"},
    ),
    "train.optimizer: muon with train.muon.ns_steps other than 5": (
        {**MUON, "muon": {"ns_steps": 6}},
        {},
    ),
    "train.optimizer: muon with train.muon.newton_schulz_dtype: float32": (
        {**MUON, "muon": {"newton_schulz_dtype": "float32"}},
        {},
    ),
}


def test_every_deepspeed_refusal_has_a_case():
    assert {setting for setting, _, _ in DEEPSPEED_REFUSED} == set(DEEPSPEED_REFUSED_CASES)


@pytest.mark.parametrize("setting", sorted(DEEPSPEED_REFUSED_CASES))
def test_a_setting_deepspeed_cannot_run_is_refused_at_start(
    setting, tmp_path, in_process, monkeypatch, caplog
):
    """Refused before anything starts (no output folder), naming the setting and why, and
    only that setting."""
    train, launch = DEEPSPEED_REFUSED_CASES[setting]
    inputs = make_inputs(tmp_path / "inputs", num_samples=8)
    config = write_config(inputs, tmp_path / "run", train=train)
    assert in_process(["--config", str(config), "--preflight"]) == 0  # fine without DeepSpeed
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # as `accelerate launch` sets it
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    assert in_process(["--config", str(config)]) == 2
    (why,) = [why for name, _, why in DEEPSPEED_REFUSED if name == setting]
    assert f"{setting} is not available under DeepSpeed ({why})" in caplog.text
    assert caplog.text.count("is not available under DeepSpeed") == 1, caplog.text
    assert not (tmp_path / "run").exists()


def test_muon_clip_under_zero2_pins_the_deepspeed_internals_it_relies_on(monkeypatch):
    """train.optimizer: muon with train.max_grad_norm under DeepSpeed clips before Newton–Schulz
    through DeepSpeed internals (components/zero_clip.py): with the DeepSpeed installed here
    nothing is missing; a DeepSpeed that renamed or moved one is a preflight error naming it,
    and install() refuses it (a run with preflight off). Planted: each of three changes."""
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero.muon import original_muon

    arch = small_arch()
    assert zero_clip.contract_problems() == []
    assert not [f for f in check_interfaces(arch, True, False, True) if f.level == "error"]

    def no_longer_imports(self, *args, **kwargs):  # a get_flat_partition of another version
        return None

    plants = {
        "muon_update is missing": lambda m: m.delattr(original_muon, "muon_update"),
        "binds muon_update at import time": lambda m: m.setattr(
            stage_1_and_2, "muon_update", original_muon.muon_update, raising=False
        ),
        "DeepSpeedZeroOptimizer.get_flat_partition no longer runs": lambda m: m.setattr(
            stage_1_and_2.DeepSpeedZeroOptimizer, "get_flat_partition", no_longer_imports
        ),
    }
    for expected, plant in plants.items():
        with monkeypatch.context() as m:
            plant(m)
            (problem,) = zero_clip.contract_problems()
            assert expected in problem and "deepspeed " in problem, problem
            errors = [str(f) for f in check_interfaces(arch, True, False, True)]
            assert any(expected in e and "train.max_grad_norm" in e for e in errors), errors
            with pytest.raises(zero_clip.ZeroClipError, match=expected):
                zero_clip.install(object(), 0.5)


def test_the_zero_stage_and_offload_are_read_from_a_deepspeed_config_file(tmp_path, monkeypatch):
    for name in ("ZERO_STAGE", "OFFLOAD_OPTIMIZER_DEVICE", "CONFIG_FILE"):
        monkeypatch.delenv(f"ACCELERATE_DEEPSPEED_{name}", raising=False)
    assert ZeroLaunch.from_environment() == ZeroLaunch(2, "none")  # Accelerate's defaults
    path = tmp_path / "ds.json"
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    path.write_text(json.dumps({"zero_optimization": zero}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    assert ZeroLaunch.from_environment() == ZeroLaunch(3, "cpu")
