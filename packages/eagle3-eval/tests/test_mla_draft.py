"""The MLA draft (vLLM's Eagle3DeepseekV2ForCausalLM) in the evaluator's own forward.

A tiny random draft directory is written by hand in the native format the exporter writes
(config.json + model.safetensors) and read back through ``Eagle3Draft.load``. The reference
is transformers' ``DeepseekV3Attention`` with ``rope_interleave=True`` (the layout vLLM runs),
fed the same tensors straight from the safetensors file, with the changes vLLM's EAGLE-3 layer
makes: ``q_a_proj`` / ``kv_a_proj_with_mqa`` read the 2H concatenation, one key/value head per
query head, ``q_a_layernorm`` / ``kv_a_layernorm`` at ``rms_norm_eps``, no bias.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3MLP,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

from eagle3_eval.config import OfflineConfig
from eagle3_eval.draft import Eagle3Draft, chain_logits
from eagle3_eval.draft_layers import KV
from eagle3_eval.draft_spec import DraftFormatError, DraftSpec, read_spec
from eagle3_eval.offline import run_offline
from eagle3_eval.preflight import PreflightError, check_target_shape, inspect_draft
from eagle3_schemas.contract.header import make_header
from eagle3_schemas.contract.lineage import fingerprint_vocab_map
from eagle3_schemas.contract.validate import validate

from support import fixtures
from support.drafts import YARN, checkpoint_tensors, random_draft, save_draft, vocab_t2d

H, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, INTER = 64, 2, 32, 512, 32, 64, 32, 128
V_TARGET, V_DRAFT, AUX = 300, 100, [1, 2, 3]
EPS = 1e-5  # not transformers' 1e-6 default of q_a/kv_a_layernorm: the eps must be wired
THETA = 50000.0


def mla_config(yarn: bool, norm_before_residual: bool = True) -> dict:
    """config.json as the exporter writes it (native route A of vLLM)."""
    if yarn:
        scaling: dict | None = dict(YARN)
        parameters = {**YARN, "rope_theta": THETA, "rope_type": "yarn"}
        del parameters["type"]
    else:
        scaling, parameters = None, {"rope_type": "default", "rope_theta": THETA}
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": H,
        "intermediate_size": INTER,
        "hidden_act": "silu",
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "q_lora_rank": Q_LORA,
        "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE,
        "qk_rope_head_dim": ROPE,
        "v_head_dim": V_DIM,
        "rms_norm_eps": EPS,
        "max_position_embeddings": 262144 if yarn else 4096,
        "rope_theta": THETA,
        "rope_scaling": scaling,
        "rope_parameters": parameters,
        "vocab_size": V_TARGET,
        "draft_vocab_size": V_DRAFT,
        "target_hidden_size": H,
        # SGLang's counting under eagle_config (vLLM's - 1), vLLM's at the top level.
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in AUX]},
        "eagle_aux_hidden_state_layer_ids": AUX,
        "norm_before_residual": norm_before_residual,
        "norm_output": False,
        "fc_norm": False,
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


def draft_target_ids() -> Tensor:
    """The target ids of the draft vocabulary: sorted, distinct, spread over the target's."""
    perm = torch.randperm(V_TARGET, generator=torch.Generator().manual_seed(7))
    return perm[:V_DRAFT].sort().values


def random_tensors(seed: int) -> dict[str, Tensor]:
    """model.safetensors of the tiny draft: weights ~ N(0, 1/fan_in), norms around 1."""
    gen = torch.Generator().manual_seed(seed)
    a = "layers.0.self_attn."
    linear = {
        "fc.weight": (H, len(AUX) * H),
        a + "q_a_proj.weight": (Q_LORA, 2 * H),
        a + "q_b_proj.weight": (HEADS * (NOPE + ROPE), Q_LORA),
        a + "kv_a_proj_with_mqa.weight": (KV_LORA + ROPE, 2 * H),
        a + "kv_b_proj.weight": (HEADS * (NOPE + V_DIM), KV_LORA),
        a + "o_proj.weight": (H, HEADS * V_DIM),
        "layers.0.mlp.gate_proj.weight": (INTER, H),
        "layers.0.mlp.up_proj.weight": (INTER, H),
        "layers.0.mlp.down_proj.weight": (H, INTER),
        "lm_head.weight": (V_DRAFT, H),
    }
    norms = {
        "layers.0.input_layernorm.weight": H,
        "layers.0.hidden_norm.weight": H,
        "layers.0.post_attention_layernorm.weight": H,
        a + "q_a_layernorm.weight": Q_LORA,
        a + "kv_a_layernorm.weight": KV_LORA,
        "norm.weight": H,
    }
    out = {k: torch.randn(s, generator=gen) * s[1] ** -0.5 for k, s in linear.items()}
    # Sharper attention so that rope and softmax scale show in the output.
    out[a + "q_b_proj.weight"] *= 3
    out.update({k: 1 + 0.2 * torch.randn(n, generator=gen) for k, n in norms.items()})
    ids = draft_target_ids()
    out["d2t"] = ids - torch.arange(V_DRAFT)
    t2d = torch.zeros(V_TARGET, dtype=torch.bool)
    t2d[ids] = True
    out["t2d"] = t2d
    return out


def write_draft(directory: Path, config: dict, seed: int = 0) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(random_tensors(seed), str(directory / "model.safetensors"))
    return directory


def embeddings(seed: int = 1) -> Tensor:
    return torch.randn(V_TARGET, H, generator=torch.Generator().manual_seed(seed))


class Reference(nn.Module):
    """vLLM's EAGLE-3 MLA layer + head rebuilt from transformers' DeepSeek-V3 modules."""

    def __init__(self, config: dict, tensors: dict[str, Tensor], rope_interleave: bool = True):
        super().__init__()
        parameters = config["rope_parameters"]
        cfg = DeepseekV3Config(
            hidden_size=H,
            intermediate_size=INTER,
            num_attention_heads=HEADS,
            num_key_value_heads=HEADS,
            q_lora_rank=Q_LORA,
            kv_lora_rank=KV_LORA,
            qk_nope_head_dim=NOPE,
            qk_rope_head_dim=ROPE,
            v_head_dim=V_DIM,
            rms_norm_eps=EPS,
            max_position_embeddings=config["max_position_embeddings"],
            rope_parameters=dict(parameters),
            rope_interleave=rope_interleave,
            attention_bias=False,
            vocab_size=V_TARGET,
        )
        cfg._attn_implementation = "eager"
        attn = DeepseekV3Attention(cfg, layer_idx=0)
        attn.q_a_proj = nn.Linear(2 * H, Q_LORA, bias=False)
        attn.kv_a_proj_with_mqa = nn.Linear(2 * H, KV_LORA + ROPE, bias=False)
        attn.q_a_layernorm.variance_epsilon = EPS
        attn.kv_a_layernorm.variance_epsilon = EPS
        self.attn, self.rotary, self.mlp = attn, DeepseekV3RotaryEmbedding(cfg), DeepseekV3MLP(cfg)
        self.input_layernorm = DeepseekV3RMSNorm(H, EPS)
        self.hidden_norm = DeepseekV3RMSNorm(H, EPS)
        self.post_attention_layernorm = DeepseekV3RMSNorm(H, EPS)
        self.norm = DeepseekV3RMSNorm(H, EPS)
        self.fc = nn.Linear(len(AUX) * H, H, bias=False)
        self.lm_head = nn.Linear(H, V_DRAFT, bias=False)
        own = {
            k.replace("self_attn.", "attn.").replace("layers.0.", ""): v
            for k, v in tensors.items()
            if k not in ("d2t", "t2d")
        }
        missing, unexpected = self.load_state_dict(own, strict=False)
        assert not unexpected and all(k.startswith("rotary.") for k in missing), (
            missing,
            unexpected,
        )
        self.norm_before_residual = config["norm_before_residual"]

    def attention(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [T, 2H], causal over the rows in order."""
        n = x.shape[0]
        cos, sin = self.rotary(x[None], positions[None])
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return self.attn(x[None], (cos, sin), causal)[0][0]

    def layer(self, embeds: Tensor, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        e = self.input_layernorm(embeds)
        if self.norm_before_residual:
            h = self.hidden_norm(hidden)
            residual = h
        else:
            residual, h = hidden, self.hidden_norm(hidden)
        residual = residual + self.attention(torch.cat([e, h], -1), positions)
        return self.mlp(self.post_attention_layernorm(residual)), residual

    def logits(self, aux: Tensor, embeds: Tensor, positions: Tensor) -> Tensor:
        out, residual = self.layer(embeds, self.fc(aux.flatten(-2)), positions)
        return self.lm_head(self.norm(out + residual))


def inputs(seed: int = 3, length: int = 12) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """aux [T, 3, H], embeds-side tokens [T], hidden [T, H], positions [T] (spread out)."""
    gen = torch.Generator().manual_seed(seed)
    aux = torch.randn(length, len(AUX), H, generator=gen)
    tokens = torch.randint(0, V_TARGET, (length,), generator=gen)
    hidden = torch.randn(length, H, generator=gen) * 2
    positions = torch.arange(length) * 389 + 5  # reach into YaRN's interpolated band
    return aux, tokens, hidden, positions


def rope_of(draft: Eagle3Draft, positions: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = draft.rotary(torch.zeros(1), positions[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("yarn", [False, True], ids=["default-rope", "yarn"])
@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_attention_layer_and_logits_match_transformers(
    tmp_path: Path, yarn: bool, norm_before_residual: bool
) -> None:
    config = mla_config(yarn, norm_before_residual)
    directory = write_draft(tmp_path / "draft", config)
    embed = embeddings()
    draft = Eagle3Draft.load(directory, embed)
    tensors = load_file(str(directory / "model.safetensors"))
    reference = Reference(config, tensors)
    aux, tokens, hidden, positions = inputs()
    n = len(tokens)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    layer = draft.layers[0]
    with torch.no_grad():
        x = torch.randn(n, 2 * H, generator=torch.Generator().manual_seed(9))
        got, _ = layer.attention(x, rope_of(draft, positions), None, mask)
        expected = reference.attention(x, positions)
        assert (got - expected).abs().max() <= 1e-5
        # The comparison can see the rope layout: neox rope on the same weights differs.
        neox = Reference(config, tensors, rope_interleave=False).attention(x, positions)
        assert (neox - expected).abs().max() > 1e-3

        embeds = embed[tokens]
        out, residual, _ = layer(embeds, hidden, None, rope_of(draft, positions), None, mask)
        ref_out, ref_residual = reference.layer(embeds, hidden, positions)
        assert (out - ref_out).abs().max() <= 1e-5
        assert (residual - ref_residual).abs().max() <= 1e-5

        step = draft(draft.combine(aux), tokens, positions, None, mask)
        ref_logits = reference.logits(aux, embeds, positions)
        assert (step.logits - ref_logits).abs().max() <= 1e-5
        assert step.logits.shape == (n, V_DRAFT)


def test_yarn_scales_softmax_and_rope_as_deepseek() -> None:
    spec = DraftSpec.from_config(mla_config(yarn=True))
    assert spec.mla is not None and spec.mla.rope_type == "deepseek_yarn"
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(64.0)).item() + 1
    assert spec.mla.softmax_scale == pytest.approx((NOPE + ROPE) ** -0.5 * mscale**2)
    assert spec.mla.rope_mscale == pytest.approx(1.0)  # mscale == mscale_all_dim
    plain = DraftSpec.from_config(mla_config(yarn=False)).mla
    assert plain is not None and plain.softmax_scale == pytest.approx((NOPE + ROPE) ** -0.5)


@pytest.mark.parametrize("yarn", [False, True], ids=["default-rope", "yarn"])
def test_incremental_decoding_equals_full_sequence(tmp_path: Path, yarn: bool) -> None:
    draft = Eagle3Draft.load(write_draft(tmp_path / "draft", mla_config(yarn)), embeddings())
    aux, tokens, _, positions = inputs(seed=4)
    n = len(tokens)
    with torch.no_grad():
        hidden = draft.combine(aux)
        full = draft(
            hidden, tokens, positions, None, torch.tril(torch.ones(n, n, dtype=torch.bool))
        )
        cache: list[KV] | None = None
        for t in range(n):
            mask = torch.ones(1, t + 1, dtype=torch.bool)
            step = draft(hidden[t : t + 1], tokens[t : t + 1], positions[t : t + 1], cache, mask)
            cache = (
                step.kv
                if cache is None
                else [KV.cat([c, s]) for c, s in zip(cache, step.kv, strict=True)]
            )
            assert (step.logits[0] - full.logits[t]).abs().max() <= 1e-5
            assert (step.chain_hidden[0] - full.chain_hidden[t]).abs().max() <= 1e-5


def test_parallel_chain_equals_vllm_schedule(tmp_path: Path) -> None:
    """chain_logits (offline mode) = first pass + chain steps fed their own output (vLLM)."""
    draft = Eagle3Draft.load(write_draft(tmp_path / "draft", mla_config(True)), embeddings())
    aux, ids, _, _ = inputs(seed=5, length=9)
    k = 3
    with torch.no_grad():
        parallel = chain_logits(draft, aux, ids, k)
        for t in range(len(ids) - k):
            n = t + 1
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
            step = draft(draft.combine(aux[:n]), ids[1 : n + 1], torch.arange(n), None, mask)
            cache, hidden = step.kv, step.chain_hidden[-1:]
            torch.testing.assert_close(parallel[0][t], step.logits[-1], rtol=1e-5, atol=1e-5)
            for j in range(1, k):
                position = t + j
                mask = torch.ones(1, position + 1, dtype=torch.bool)
                token = ids[t + 1 + j : t + 2 + j]
                step = draft(hidden, token, torch.tensor([position]), cache, mask)
                cache = [KV.cat([c, s]) for c, s in zip(cache, step.kv, strict=True)]
                hidden = step.chain_hidden
                torch.testing.assert_close(parallel[j][t], step.logits[0], rtol=1e-5, atol=1e-5)


def test_d2t_maps_draft_argmax_to_target_ids(tmp_path: Path) -> None:
    directory = write_draft(tmp_path / "draft", mla_config(False))
    draft = Eagle3Draft.load(directory, embeddings())
    ids = draft_target_ids()
    assert torch.equal(draft.target_ids(), ids)  # target id = i + d2t[i]
    t2d = load_file(str(directory / "model.safetensors"))["t2d"]
    assert torch.equal(vocab_t2d(draft.d2t, V_TARGET), t2d)
    aux, tokens, _, positions = inputs()
    n = len(tokens)
    with torch.no_grad():
        logits = draft(
            draft.combine(aux), tokens, positions, None, torch.tril(torch.ones(n, n).bool())
        ).logits
    local = logits.argmax(-1)
    assert len(set(local.tolist())) > 1  # a nontrivial check
    # vLLM compute_logits: draft logits scattered into a -inf target vocabulary.
    full = logits.new_full((n, V_TARGET), float("-inf"))
    full[:, ids] = logits
    assert torch.equal(draft.to_target_ids(local), full.argmax(-1))
    assert torch.equal(draft.to_target_ids(local), ids[local])


def write_lineage(directory: Path) -> None:
    """eagle3.json as the exporter writes it for the MLA variant."""
    tensors = load_file(str(directory / "model.safetensors"))
    lineage = {
        "target_fingerprint": fixtures.fake_fingerprint("target"),
        "tokenizer_fingerprint": fixtures.fake_fingerprint("tokenizer"),
        "hidden_states_fingerprint": fixtures.fake_fingerprint("hidden_states"),
        "vocab_map_fingerprint": fingerprint_vocab_map(
            tensors["d2t"].numpy(), tensors["t2d"].numpy()
        ),
    }
    header = make_header(
        "draft_checkpoint", lineage, aux_layer_ids=AUX, training={}, architecture="mla"
    )
    (directory / "eagle3.json").write_text(json.dumps(header.to_json()))


def test_spec_fields_and_preflight(tmp_path: Path) -> None:
    directory = write_draft(tmp_path / "draft", mla_config(True, norm_before_residual=False))
    write_lineage(directory)
    assert validate(directory) == []  # the hand-built directory is a draft_checkpoint (mla)
    spec = read_spec(directory)
    assert spec.kind == "mla"
    assert spec.aux_layer_ids == tuple(AUX)
    assert (spec.target_hidden_size, spec.hidden_size) == (H, H)
    assert (spec.target_vocab_size, spec.draft_vocab_size) == (V_TARGET, V_DRAFT)
    assert spec.norm_before_residual is False
    assert spec.num_layers == 1 and spec.vllm_notes == ()
    info = inspect_draft(directory)  # strict: validates against the schema
    assert info.spec == spec and info.lineage is not None
    target = {"hidden_size": H, "vocab_size": V_TARGET, "num_hidden_layers": 4}
    check_target_shape(spec, target, "target")
    with pytest.raises(PreflightError, match="vocab_size"):
        check_target_shape(spec, {**target, "vocab_size": 301}, "target")


def test_native_norm_before_residual_defaults_to_false() -> None:
    # deepseek_eagle3.py: getattr(config, "norm_before_residual", False) on the native route.
    config = mla_config(False)
    del config["norm_before_residual"]
    assert DraftSpec.from_config(config).norm_before_residual is False


def test_what_vllm_would_not_load_is_refused_or_noted() -> None:
    for key, value, match in [
        ("q_lora_rank", None, "q_lora_rank is null"),
        ("hidden_act", "gelu", "only silu"),
        ("attention_bias", True, "no biases"),
    ]:
        with pytest.raises(DraftFormatError, match=match):
            DraftSpec.from_config({**mla_config(False), key: value})
    notes = DraftSpec.from_config({**mla_config(False), "model_type": "deepseek_v3"}).vllm_notes
    assert any("deepseek_mtp" in n for n in notes)
    config = mla_config(False)
    config["eagle_config"] = {}
    config["eagle_aux_hidden_state_layer_ids"] = [1, 2]
    notes = DraftSpec.from_config(config).vllm_notes
    assert any("sizes this draft's fc for 3" in n for n in notes)


def test_the_aux_ids_are_read_in_each_servers_counting() -> None:
    """eagle_config holds SGLang's ids (vLLM's - 1) beside vLLM's at the top level: no note.
    The legacy copy of vLLM's ids under eagle_config (the pre-fix export) is read for vLLM with
    a note that SGLang would feed layers one off; two lists that say different layers are
    refused."""
    spec = DraftSpec.from_config(mla_config(False))
    assert list(spec.aux_layer_ids) == AUX and not any("eagle_config" in n for n in spec.vllm_notes)
    legacy = mla_config(False)
    legacy["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": AUX}
    spec = DraftSpec.from_config(legacy)
    assert list(spec.aux_layer_ids) == AUX and any("one off" in n for n in spec.vllm_notes)
    legacy["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [i + 1 for i in AUX]}
    with pytest.raises(DraftFormatError, match="are neither"):
        DraftSpec.from_config(legacy)


def test_save_load_round_trip(tmp_path: Path) -> None:
    config = mla_config(True)
    draft = Eagle3Draft.load(write_draft(tmp_path / "draft", config), embeddings())
    out = save_draft(draft, tmp_path / "again", config, None)
    again = Eagle3Draft.load(out, embeddings())
    before, after = checkpoint_tensors(draft), checkpoint_tensors(again)
    assert set(before) == set(random_tensors(0))
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_offline_mode_runs_an_mla_draft(tmp_path: Path, fixture_hidden_states: Path) -> None:
    """Offline mode, unchanged, on an MLA draft sized for the schema fixture's target."""
    config = {
        **mla_config(True),
        "hidden_size": 8,
        "intermediate_size": 16,
        "q_lora_rank": 8,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 4,
        "qk_rope_head_dim": 4,
        "v_head_dim": 4,
        "vocab_size": 32,
        "draft_vocab_size": 12,
        "target_hidden_size": 8,
    }
    spec = DraftSpec.from_config(config)
    assert any("576" in note for note in spec.vllm_notes)  # kv_lora_rank 16: noted, not fatal
    _, d2t, _ = fixtures.vocab_arrays()
    embed = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
    draft = random_draft(spec, embed, torch.from_numpy(d2t), seed=1)
    directory = save_draft(draft, tmp_path / "draft", config, None)
    results = run_offline(
        OfflineConfig(
            draft=directory,
            hidden_states=fixture_hidden_states,
            out=tmp_path / "report",
            k=2,
            temperatures=(0.0,),
        )
    )
    summary = results[0].summary
    assert summary.num_drafts == 2 + 4 + 3  # the fixture's anchors, as for the Llama draft
    assert any("576" in note for note in results[0].extra["notes"])
