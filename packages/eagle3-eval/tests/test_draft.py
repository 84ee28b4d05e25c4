"""The draft's inference forward: checkpoint reading, vLLM defaults, chain = incremental."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from eagle3_eval.draft import Eagle3Draft, chain_logits
from eagle3_eval.draft_layers import KV
from eagle3_eval.draft_spec import DraftFormatError, DraftSpec, read_spec
from eagle3_schemas.contract.header import make_header
from eagle3_schemas.contract.lineage import fingerprint_vocab_map
from eagle3_schemas.contract.validate import validate

from support import fixtures
from support.drafts import checkpoint_tensors, random_draft, save_draft


def _embed(spec: DraftSpec, seed: int = 0) -> torch.Tensor:
    return torch.randn(
        spec.target_vocab_size, spec.hidden_size, generator=torch.Generator().manual_seed(seed)
    )


def test_fixture_checkpoint_loads_with_its_vocab_map(fixture_draft: Path) -> None:
    spec = read_spec(fixture_draft)
    assert spec.aux_layer_ids == (1, 2, 3)
    assert (spec.draft_vocab_size, spec.target_vocab_size) == (12, 32)
    draft = Eagle3Draft.load(fixture_draft, _embed(spec))
    _, d2t, _ = fixtures.vocab_arrays()
    expected = torch.arange(12) + torch.from_numpy(d2t)
    assert torch.equal(draft.target_ids(), expected)  # target id = i + d2t[i]


def test_norm_before_residual_defaults_to_true_as_in_vllm() -> None:
    # vLLM's speculators conversion uses config_dict.get("norm_before_residual", True).
    config = fixtures.draft_config()
    del config["norm_before_residual"]
    assert DraftSpec.from_config(config).norm_before_residual is True


def test_unsorted_aux_ids_are_refused() -> None:
    # vLLM concatenates the target's states for sorted(set(ids)): another order misfeeds fc.
    config = fixtures.draft_config()
    config["eagle_aux_hidden_state_layer_ids"] = [3, 1, 2]
    with pytest.raises(DraftFormatError, match="sorted and unique"):
        DraftSpec.from_config(config)


def test_combine_applies_norm_before_fc_then_fc_norm_as_vllm() -> None:
    # vLLM 0.32 llama_eagle3.py, combine_hidden_states: input_norm (norm_before_fc) over the
    # concatenation, then fc_norm per aux chunk of the result, then fc. With both flags set
    # the order matters; it was once applied the other way round here.
    config = fixtures.draft_config()
    config["norm_before_fc"] = True
    config["fc_norm"] = True
    spec = DraftSpec.from_config(config)
    draft = random_draft(spec, _embed(spec), seed=2)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        assert draft.input_norm is not None and draft.fc_norm is not None
        draft.input_norm.weight.copy_(1 + torch.randn(draft.input_norm.weight.shape, generator=gen))
        for norm in draft.fc_norm:
            norm.weight.copy_(1 + torch.randn(norm.weight.shape, generator=gen))
        scales = torch.tensor([1.0, 8.0, 30.0])[None, :, None]  # aux layers of growing size
        aux = torch.randn(5, spec.num_aux, spec.target_hidden_size, generator=gen) * scales

        def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + spec.rms_norm_eps))

        h = rms(aux.flatten(-2), draft.input_norm.weight)
        chunks = h.chunk(spec.num_aux, dim=-1)
        h = torch.cat([rms(c, n.weight) for c, n in zip(chunks, draft.fc_norm, strict=True)], -1)
        expected = h @ draft.fc.weight.T
        reversed_order = (
            rms(
                torch.stack(
                    [rms(aux[:, i], n.weight) for i, n in enumerate(draft.fc_norm)], 1
                ).flatten(-2),
                draft.input_norm.weight,
            )
            @ draft.fc.weight.T
        )
        got = draft.combine(aux)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (got - reversed_order).abs().max() > 1e-2  # the test can tell the two orders apart


def test_wrong_shape_is_named(fixture_draft: Path) -> None:
    config = json.loads((fixture_draft / "config.json").read_text())
    config["transformer_layer_config"]["intermediate_size"] = 17
    (fixture_draft / "config.json").write_text(json.dumps(config))
    spec = read_spec(fixture_draft)
    with pytest.raises(DraftFormatError, match=r"mlp\.\w+_proj\.weight has shape"):
        Eagle3Draft.load(fixture_draft, _embed(spec))


def _incremental(draft: Eagle3Draft, aux: torch.Tensor, ids: torch.Tensor, t: int, k: int):
    """vLLM's schedule at anchor t: first pass over rows 0..t, then k-1 chain steps."""
    n = t + 1
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    step = draft(draft.combine(aux[:n]), ids[1 : n + 1], torch.arange(n), None, mask)
    cache = step.kv
    logits, hidden = [step.logits[-1]], step.chain_hidden[-1:]
    for j in range(1, k):
        position = t + j
        mask = torch.ones(1, position + 1, dtype=torch.bool)
        step = draft(hidden, ids[t + 1 + j : t + 2 + j], torch.tensor([position]), cache, mask)
        cache = [KV.cat([c, s]) for c, s in zip(cache, step.kv, strict=True)]
        logits.append(step.logits[0])
        hidden = step.chain_hidden
    return logits


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_parallel_chain_equals_incremental_decoding(norm_before_residual: bool) -> None:
    config = fixtures.draft_config()
    config["norm_before_residual"] = norm_before_residual
    spec = DraftSpec.from_config(config)
    draft = random_draft(spec, _embed(spec), seed=3)
    with torch.no_grad():
        for module in draft.checkpoint_modules().values():
            module.weight.mul_(20)  # large weights: differences would show
    gen = torch.Generator().manual_seed(1)
    seq_len, k = 11, 3
    aux = torch.randn(seq_len, 3, 8, generator=gen)
    ids = torch.randint(0, 32, (seq_len,), generator=gen)
    with torch.no_grad():
        parallel = chain_logits(draft, aux, ids, k)
        for t in range(seq_len - k):
            for j, logits in enumerate(_incremental(draft, aux, ids, t, k)):
                torch.testing.assert_close(parallel[j][t], logits, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_is_a_valid_artifact(tmp_path: Path) -> None:
    config = fixtures.draft_config()
    spec = DraftSpec.from_config(config)
    _, d2t, t2d = fixtures.vocab_arrays()
    draft = random_draft(spec, _embed(spec), torch.from_numpy(d2t), seed=5)
    lineage = {
        "target_fingerprint": fixtures.fake_fingerprint("target"),
        "tokenizer_fingerprint": fixtures.fake_fingerprint("tokenizer"),
        "hidden_states_fingerprint": fixtures.fake_fingerprint("hidden_states"),
        "vocab_map_fingerprint": fingerprint_vocab_map(d2t, t2d),
    }
    header = make_header(
        "draft_checkpoint", lineage, aux_layer_ids=[1, 2, 3], training={}, architecture="llama"
    )
    out = save_draft(draft, tmp_path / "draft", config, header.to_json())
    assert validate(out) == []
    again = Eagle3Draft.load(out, draft.embed_tokens.weight)
    for name, tensor in checkpoint_tensors(draft).items():
        assert torch.equal(checkpoint_tensors(again)[name], tensor), name


def test_an_sglang_layout_draft_reads_as_the_same_draft(
    fixture_draft: Path, tmp_path: Path
) -> None:
    """SpecForge's layout of the fixture draft (by hand: tests/support/sglang_layout.py) reads
    to the same spec, aux ids converted to vLLM's counting, the same weights, the same logits."""
    from support.sglang_layout import sglang_copy

    sglang = sglang_copy(fixture_draft, tmp_path / "sglang")
    ours, theirs = read_spec(fixture_draft), read_spec(sglang)
    assert theirs.aux_layer_ids == ours.aux_layer_ids == (1, 2, 3)
    assert (theirs.layout, ours.layout) == ("sglang", "speculators")
    assert "[0, 1, 2] in SGLang" in theirs.layout_note
    embed = _embed(ours)
    a, b = Eagle3Draft.load(fixture_draft, embed), Eagle3Draft.load(sglang, embed)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    aux = torch.randn(5, 3, ours.target_hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([1, 4, 7, 2, 9])
    for x, y in zip(chain_logits(a, aux, ids, 2), chain_logits(b, aux, ids, 2), strict=True):
        assert torch.equal(x, y)


def test_sglang_layout_refusals(fixture_draft: Path, tmp_path: Path) -> None:
    from support.sglang_layout import sglang_copy

    sglang = sglang_copy(fixture_draft, tmp_path / "sglang")
    config = json.loads((sglang / "config.json").read_text(encoding="utf-8"))
    mixed = {**config, "transformer_layer_config": {}}
    with pytest.raises(DraftFormatError, match=r"mixes draft layouts.*transformer_layer_config"):
        DraftSpec.from_config(mixed)
    two = {**config, "eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    with pytest.raises(DraftFormatError, match="cannot be placed"):
        DraftSpec.from_config(two)
    deeper = {**config, "num_hidden_layers": 2}
    with pytest.raises(DraftFormatError, match="drop the residual"):
        DraftSpec.from_config(deeper)


def test_vllm_is_handed_the_sglang_ids_in_its_own_counting(
    fixture_draft: Path, tmp_path: Path
) -> None:
    """vLLM reads a flat config's aux ids as they are: a SpecForge-layout draft (eagle_config
    only, SGLang's counting) is served through a view stating them converted; weights linked."""
    from eagle3_eval.draft_spec import vllm_view

    from support.sglang_layout import sglang_copy

    sglang = sglang_copy(fixture_draft, tmp_path / "sglang")
    view = Path(vllm_view(sglang, tmp_path / "job"))
    assert view != sglang
    config = json.loads((view / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # the fixture's vLLM ids
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert (view / "model.safetensors").resolve() == (sglang / "model.safetensors").resolve()
    assert read_spec(view).aux_layer_ids == read_spec(sglang).aux_layer_ids
    assert vllm_view(fixture_draft, tmp_path / "job2") == str(fixture_draft)  # as it is


def test_a_full_vocabulary_draft_reads_with_or_without_the_legacy_d2t(tmp_path: Path) -> None:
    """A full-vocabulary draft stores no d2t (its map is the identity) and validates; one
    written before that rule, holding the d2t vLLM refuses, still reads and loads here, with a
    note naming the tensor and the engine, and is refused before a vLLM engine starts."""
    from safetensors.torch import load_file, save_file

    from eagle3_eval.preflight import PreflightError, check_served_by_vllm, inspect_draft
    from eagle3_schemas.layouts.draft_vocab import identity_vocab_map

    config = fixtures.draft_config()
    vocab = config["transformer_layer_config"]["vocab_size"]
    config["draft_vocab_size"] = vocab
    spec = DraftSpec.from_config(config)
    draft = random_draft(spec, _embed(spec), seed=5)
    lineage = {
        "target_fingerprint": fixtures.fake_fingerprint("target"),
        "tokenizer_fingerprint": fixtures.fake_fingerprint("tokenizer"),
        "hidden_states_fingerprint": fixtures.fake_fingerprint("hidden_states"),
        "vocab_map_fingerprint": fingerprint_vocab_map(*identity_vocab_map(vocab)),
    }
    header = make_header(
        "draft_checkpoint", lineage, aux_layer_ids=[1, 2, 3], training={}, architecture="llama"
    )
    out = save_draft(draft, tmp_path / "draft", config, header.to_json())
    assert "d2t" not in load_file(str(out / "model.safetensors"))
    info = inspect_draft(out)
    assert info.unserved == []
    check_served_by_vllm(info)
    Eagle3Draft.load(out, draft.embed_tokens.weight)

    legacy = tmp_path / "legacy"
    shutil.copytree(out, legacy)
    (legacy / "eagle3.json").unlink()  # a foreign draft: no v3 header to hold it to the rule
    tensors = load_file(str(legacy / "model.safetensors"))
    save_file(
        {**tensors, "d2t": torch.zeros(vocab, dtype=torch.int64)}, str(legacy / "model.safetensors")
    )
    info = inspect_draft(legacy)
    assert (
        len(info.unserved) == 1 and "tensor d2t: vLLM's Eagle3LlamaForCausalLM" in info.unserved[0]
    )
    assert info.unserved[0] in info.notes
    loaded = Eagle3Draft.load(legacy, draft.embed_tokens.weight)
    assert torch.equal(loaded.lm_head.weight, draft.lm_head.weight)
    with pytest.raises(PreflightError, match="vLLM would not serve this draft"):
        check_served_by_vllm(info)
