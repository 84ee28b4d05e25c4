"""The EAGLE-3 draft at inference time, written from vLLM's semantics, not from the trainer.

This is an independent reading of the speculators ``eagle3`` checkpoint format (config.json +
model.safetensors) and of what vLLM 0.32 computes with it (``model_executor/models/
llama_eagle3.py``, ``transformers_utils/configs/speculators/algos.py``,
``v1/spec_decode/llm_base_proposer.py``). It shares no code with eagle3-train, so a draft that
scores the same here and in vLLM proves format and alignment; a disagreement is a finding.

What vLLM computes:

- Aux states: the target collects the residual stream after k layers for each id k in
  ``sorted(set(eagle_aux_hidden_state_layer_ids))`` and concatenates them in that order.
- ``combine``: [optional RMSNorm over the concatenation (``norm_before_fc``, weight
  ``input_norm.weight``)] [optional per-chunk RMSNorms (``fc_norm``, ``fc_norm.{i}.weight``)]
  then ``fc`` [n_aux·H_target] -> H. Only *target* states go through it; later chain steps
  feed the draft's own output.
- Pairing: draft row t gets the target state of position t (the target has seen x_0..x_t) and
  the embedding of x_{t+1} (vLLM shifts input ids left by one and puts the token just sampled
  last); rope position t; its output predicts x_{t+2}.
- Layer 0: ``e = input_layernorm(embed(x))``; ``residual = h``, ``h = hidden_norm(h)`` (with
  ``norm_before_residual`` — vLLM's default when the key is absent — the residual is the
  normed h); q/k/v read ``cat(e, h)`` [2H]; causal GQA attention with rope -> o_proj;
  ``residual += attn``; ``mlp(post_attention_layernorm(residual))``. Layers 1.. are plain
  Llama layers continuing the residual. ``prenorm = mlp + residual``.
- ``logits = logit_scale · lm_head(norm(prenorm))`` over the draft vocabulary; draft id i is
  target id ``i + d2t[i]`` unless the draft vocabulary is the target's (then the map is the
  identity and vLLM holds no ``d2t``); ``t2d`` is ignored. The next chain step gets ``prenorm`` (``norm(prenorm)`` with
  ``norm_output``).
- Embeddings are the target's unless the checkpoint stores ``embed_tokens.weight``.

The MLA draft (vLLM's ``Eagle3DeepseekV2ForCausalLM``, ``model_executor/models/
deepseek_eagle3.py``; ``Eagle3DeepseekV3ForCausalLM`` is an alias) is read from vLLM's native
config format instead (flat config.json, ``architectures`` naming the class, ``model_type``
``deepseek_v2``). Everything above holds for it except the attention block, which is DeepSeek's
multi-head latent attention (``deepseek_v2.py`` ``DeepseekV2MLAAttention``, ``layers/mla.py``):

- ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` per head ``[q_nope | q_pe]``;
  ``kv_a_proj_with_mqa(x)`` = ``[c_kv | k_pe]``, ``c_kv = kv_a_layernorm(c_kv)``;
  ``kv_b_proj(c_kv)`` per head ``[k_nope | v]``; ``k_pe`` is one head shared by all heads.
  Layer 0's ``x`` is the 2H concatenation; only ``q_a_proj`` and ``kv_a_proj_with_mqa`` read it.
- Rope on ``q_pe`` and ``k_pe`` only, always interleaved (GPT-J pairs ``x[2i], x[2i+1]``),
  dimension ``qk_rope_head_dim``. Any rope type other than ``default`` becomes DeepSeek YaRN
  (``DeepseekScalingRotaryEmbedding``): YaRN-ramped inverse frequencies, cos/sin scaled by
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``.
- Softmax scale ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
  ``mscale(factor, mscale_all_dim) ** 2`` with DeepSeek YaRN.
- The MLP is dense (never MoE), SiLU only; there is no ``norm_before_fc``, no bias, and
  ``norm_before_residual`` defaults to False on this route.

Computation is float32 by default: the point of this module is exactness, not speed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3_eval.draft_spec import (
    ATTENTION,
    MLA_ATTENTION,
    MLA_NORMS,
    MLP,
    WEIGHTS_FILE,
    DraftFormatError,
    DraftSpec,
    MLASpec,
    checkpoint_names,
    read_spec,
)


class RMSNorm(nn.Module):
    """vLLM's RMSNorm: normalised in float32, then scaled by the weight."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Neox-style rope (Llama's): x [n, heads, d], cos/sin [n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """GPT-J-style rope (vLLM ``is_neox_style=False``): pairs (x[2i], x[2i+1]) rotate by angle i.

    x [n, heads, d], cos/sin [n, d/2]; the output keeps the interleaved layout.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None) -> Tensor:
    """Softmax attention of q [n_q, heads, d] over k [n_k, kv_heads, d], v [n_k, kv_heads, d_v]
    where mask is True.

    mask [n_q, n_k] bool. Grouped-query heads share keys; scores run in float32 and are scaled
    by ``scale`` (default d^-0.5).
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float())
    scores = scores / math.sqrt(q.shape[-1]) if scale is None else scores * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v.float()).to(q.dtype)


@dataclass
class KV:
    """Keys and values of some draft rows for one layer: [n, kv_heads, d] each."""

    k: Tensor
    v: Tensor

    @staticmethod
    def cat(parts: list[KV]) -> KV:
        return KV(torch.cat([p.k for p in parts]), torch.cat([p.v for p in parts]))

    def __len__(self) -> int:
        return self.k.shape[0]


@dataclass
class DraftStep:
    """Output of one draft forward over n rows."""

    logits: Tensor  # [n, V_draft]
    chain_hidden: Tensor  # [n, H]: what the next chain step is fed
    kv: list[KV]  # per layer, the new rows' keys and values


class DecoderLayer(nn.Module):
    """What every draft layer shares: the layer input (``layer_input``), residuals, the
    post-attention norm and the dense SiLU MLP. Subclasses build the attention and name it."""

    ATTENTION_NAMES: tuple[str, ...] = ()
    hidden_norm_in_every_layer = False

    def __init__(self, spec: DraftSpec, index: int) -> None:
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.spec, self.index = spec, index
        self.gate_proj = nn.Linear(h, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        if index == 0 or self.hidden_norm_in_every_layer:
            self.hidden_norm = RMSNorm(h, eps)
        self.act = ACT2FN[spec.hidden_act]

    def checkpoint_modules(self) -> dict[str, nn.Module]:
        prefix = f"layers.{self.index}."
        out: dict[str, nn.Module] = {}
        for name in self.ATTENTION_NAMES:
            out[f"{prefix}self_attn.{name}"] = getattr(self, name)
        for name in MLP:
            out[f"{prefix}mlp.{name}"] = getattr(self, name)
        for name in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            if hasattr(self, name):
                out[prefix + name] = getattr(self, name)
        return out

    def attention(
        self, x: Tensor, rope: tuple[Tensor, Tensor], past: KV | None, mask: Tensor
    ) -> tuple[Tensor, KV]:
        """Attention of x [n, 2H or H] -> (o_proj output [n, H], these rows' KV)."""
        raise NotImplementedError

    def forward(
        self,
        embeds: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        rope: tuple[Tensor, Tensor],
        past: KV | None,
        mask: Tensor,
    ) -> tuple[Tensor, Tensor, KV]:
        """Returns (mlp output, residual, this layer's new KV) — vLLM keeps the two apart."""
        x, residual = layer_input(self, embeds, hidden, residual)
        attention, new = self.attention(x, rope, past, mask)
        residual = residual + attention
        x = self.post_attention_layernorm(residual)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x)), residual, new


class DraftLayer(DecoderLayer):
    """One Llama decoder layer; layer 0 reads cat(embeds, hidden) [2H]."""

    ATTENTION_NAMES = ATTENTION

    def __init__(self, spec: DraftSpec, index: int) -> None:
        super().__init__(spec, index)
        h = spec.hidden_size
        q_dim = spec.num_attention_heads * spec.head_dim
        kv_dim = spec.num_key_value_heads * spec.head_dim
        qkv_in = 2 * h if index == 0 else h
        self.q_proj = nn.Linear(qkv_in, q_dim, bias=spec.attention_bias)
        self.k_proj = nn.Linear(qkv_in, kv_dim, bias=spec.attention_bias)
        self.v_proj = nn.Linear(qkv_in, kv_dim, bias=spec.attention_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=False)

    def attention(
        self, x: Tensor, rope: tuple[Tensor, Tensor], past: KV | None, mask: Tensor
    ) -> tuple[Tensor, KV]:
        spec = self.spec
        n = x.shape[0]
        cos, sin = rope
        q = rotate(self.q_proj(x).view(n, spec.num_attention_heads, spec.head_dim), cos, sin)
        k = rotate(self.k_proj(x).view(n, spec.num_key_value_heads, spec.head_dim), cos, sin)
        v = self.v_proj(x).view(n, spec.num_key_value_heads, spec.head_dim)
        new = KV(k, v)
        keys = new if past is None else KV.cat([past, new])
        return self.o_proj(attend(q, keys.k, keys.v, mask).flatten(-2)), new


def layer_input(
    layer: nn.Module, embeds: Tensor, hidden: Tensor, residual: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The attention input and the residual of a draft layer (llama_eagle3.py and
    deepseek_eagle3.py alike): layer 0 reads cat(input_layernorm(embeds), hidden_norm(h)) [2H]
    with the residual h (normed with ``norm_before_residual``); later layers add the previous
    layer's residual and apply input_layernorm."""
    if layer.index == 0:
        embeds = layer.input_layernorm(embeds)
        if layer.spec.norm_before_residual:
            hidden = layer.hidden_norm(hidden)
            residual = hidden
        else:
            residual = hidden
            hidden = layer.hidden_norm(hidden)
        return torch.cat([embeds, hidden], dim=-1), residual
    assert residual is not None
    residual = hidden + residual
    return layer.input_layernorm(residual), residual


class MLADraftLayer(DecoderLayer):
    """One layer of vLLM's DeepseekV2Eagle3Model: MLA attention, dense SiLU MLP.

    Layer 0's ``q_a_proj`` and ``kv_a_proj_with_mqa`` read cat(embeds, hidden) [2H]. The KV
    rows are kept expanded (keys [n, heads, nope + rope], values [n, heads, v_head_dim]);
    vLLM caches the latent (c_kv, k_pe) and absorbs kv_b_proj, which is the same product.
    """

    ATTENTION_NAMES = MLA_ATTENTION + MLA_NORMS
    hidden_norm_in_every_layer = True  # as vLLM builds it; only layer 0 uses it

    def __init__(self, spec: DraftSpec, index: int) -> None:
        super().__init__(spec, index)
        mla = spec.mla
        assert mla is not None
        h, heads, eps = spec.hidden_size, spec.num_attention_heads, spec.rms_norm_eps
        x_in = 2 * h if index == 0 else h
        self.mla = mla
        self.q_a_proj = nn.Linear(x_in, mla.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(mla.q_lora_rank, eps)
        self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            x_in, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, h, bias=False)

    def attention(
        self, x: Tensor, rope: tuple[Tensor, Tensor], past: KV | None, mask: Tensor
    ) -> tuple[Tensor, KV]:
        """MLA of x [n, 2H or H] -> (o_proj output [n, H], these rows' KV)."""
        mla, heads = self.mla, self.spec.num_attention_heads
        nope, rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        n = x.shape[0]
        cos, sin = rope
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(n, heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([nope, rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rotate_interleaved(q_pe, cos, sin)
        k_pe = rotate_interleaved(k_pe[:, None, :], cos, sin)  # one head, shared by all
        k_nope, v = (
            self.kv_b_proj(c_kv)
            .view(n, heads, nope + mla.v_head_dim)
            .split([nope, mla.v_head_dim], dim=-1)
        )
        new = KV(torch.cat([k_nope, k_pe.expand(n, heads, rope_dim)], dim=-1), v.contiguous())
        keys = new if past is None else KV.cat([past, new])
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = attend(q, keys.k, keys.v, mask, mla.softmax_scale)
        return self.o_proj(out.flatten(-2)), new


class MLARotaryEmbedding(nn.Module):
    """cos/sin [1, n, qk_rope_head_dim / 2] of vLLM's MLA rope (plain or DeepSeek YaRN).

    Computed in float32 from the spec at every call, so casting the draft to another dtype
    does not round the frequencies.
    """

    def __init__(self, mla: MLASpec) -> None:
        super().__init__()
        self.mla = mla

    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        inv_freq = self.mla.inv_freq().to(x.device)
        freqs = position_ids[..., None].float() * inv_freq
        mscale = self.mla.rope_mscale
        return freqs.cos() * mscale, freqs.sin() * mscale


class Eagle3Draft(nn.Module):
    """An EAGLE-3 draft (Llama or MLA) with vLLM's forward; tensor names are the checkpoint's."""

    def __init__(self, spec: DraftSpec, embed_tokens: Tensor) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        if tuple(embed_tokens.shape) != (spec.target_vocab_size, h):
            raise DraftFormatError(
                f"embeddings have shape {list(embed_tokens.shape)}; the draft needs "
                f"[{spec.target_vocab_size}, {h}] (target vocab_size, draft hidden_size)"
            )
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens.detach().float().clone())
        fc_in = spec.num_aux * spec.target_hidden_size
        self.input_norm = RMSNorm(fc_in, spec.rms_norm_eps) if spec.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(
                RMSNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in range(spec.num_aux)
            )
            if spec.fc_norm
            else None
        )
        self.fc = nn.Linear(fc_in, h, bias=False)
        layer_class = DraftLayer if spec.mla is None else MLADraftLayer
        self.layers = nn.ModuleList(layer_class(spec, n) for n in range(spec.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.rotary: nn.Module
        if spec.mla is not None:
            self.rotary = MLARotaryEmbedding(spec.mla)
        else:
            # Rope as the draft's own layer config describes it (scaling types included).
            self.rotary = LlamaRotaryEmbedding(
                LlamaConfig(**{**spec.layer_config, "head_dim": spec.head_dim})
            )

    # ---- checkpoint names <-> modules -----------------------------------------------------

    def checkpoint_modules(self) -> dict[str, nn.Module]:
        """Checkpoint tensor name prefix -> module (holding ``.weight``, maybe ``.bias``)."""
        out: dict[str, nn.Module] = {"fc": self.fc, "norm": self.norm, "lm_head": self.lm_head}
        if self.input_norm is not None:
            out["input_norm"] = self.input_norm
        if self.fc_norm is not None:
            for n, module in enumerate(self.fc_norm):
                out[f"fc_norm.{n}"] = module
        for layer in self.layers:
            out.update(layer.checkpoint_modules())  # type: ignore[operator]
        return out

    def load_tensors(self, tensors: dict[str, Tensor], where: str) -> None:
        spec = self.spec
        shapes = spec.expected_shapes()
        missing = sorted(set(shapes) - set(tensors) - spec.optional_tensors())
        if missing:
            raise DraftFormatError(f"{where}: missing tensors {', '.join(missing[:8])}")
        unknown = sorted(set(tensors) - set(shapes))
        if unknown:
            raise DraftFormatError(
                f"{where}: tensors {', '.join(unknown[:8])} are not part of the draft config.json "
                "describes (more layers? norm_before_fc / fc_norm flags?)"
            )
        for name, tensor in tensors.items():
            if tuple(tensor.shape) != shapes[name]:
                raise DraftFormatError(
                    f"{where}: tensor {name} has shape {list(tensor.shape)}; config.json implies "
                    f"{list(shapes[name])}"
                )
        with torch.no_grad():
            for prefix, module in self.checkpoint_modules().items():
                module.weight.copy_(tensors[f"{prefix}.weight"].float())
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(tensors[f"{prefix}.bias"].float())
            if "embed_tokens.weight" in tensors:
                self.embed_tokens.weight.copy_(tensors["embed_tokens.weight"].float())
            if not spec.same_vocab:
                d2t = tensors["d2t"].long()
                target_ids = torch.arange(len(d2t)) + d2t
                if target_ids.min() < 0 or target_ids.max() >= spec.target_vocab_size:
                    raise DraftFormatError(
                        f"{where}: d2t maps draft ids outside the target vocabulary "
                        f"[0, {spec.target_vocab_size})"
                    )
                self.d2t.copy_(d2t)

    @classmethod
    def load(
        cls, directory: str | Path, embed_tokens: Tensor, dtype: torch.dtype = torch.float32
    ) -> Eagle3Draft:
        """Load ``directory`` (speculators eagle3, native MLA, or SGLang / SpecForge) with the
        target's embeddings."""
        from safetensors.torch import load_file

        directory = Path(directory)
        spec = read_spec(directory)
        weights = directory / WEIGHTS_FILE
        if not weights.is_file():
            raise DraftFormatError(f"{directory}: no {WEIGHTS_FILE}")
        model = cls(spec, embed_tokens)
        tensors = checkpoint_names(spec, load_file(str(weights)), str(weights))
        model.load_tensors(tensors, str(weights))
        return model.to(dtype).eval()

    # ---- the forward ----------------------------------------------------------------------

    def combine(self, aux_hidden_states: Tensor) -> Tensor:
        """Target aux states [n, n_aux, H_target] (ascending layer ids) -> draft input [n, H]."""
        x = aux_hidden_states.to(self.fc.weight.dtype).flatten(-2)
        # vLLM's order (llama_eagle3.py combine_hidden_states): input_norm over the whole
        # concatenation first, then fc_norm per aux chunk of it.
        if self.input_norm is not None:
            x = self.input_norm(x)
        if self.fc_norm is not None:
            chunks = x.chunk(self.spec.num_aux, dim=-1)
            x = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        return self.fc(x)

    def forward(
        self,
        hidden: Tensor,
        tokens: Tensor,
        positions: Tensor,
        past: list[KV] | None,
        mask: Tensor,
    ) -> DraftStep:
        """n new rows: hidden [n, H], tokens [n] (target ids), positions [n].

        ``past`` holds per layer the keys/values the rows may attend to besides their own;
        ``mask`` [n, len(past) + n] says which (True = attend).
        """
        cos, sin = self.rotary(hidden, positions[None].long())
        rope = (cos[0].to(hidden.dtype), sin[0].to(hidden.dtype))
        embeds = self.embed_tokens(tokens.long()).to(hidden.dtype)
        residual: Tensor | None = None
        new_kv: list[KV] = []
        for n, layer in enumerate(self.layers):
            hidden, residual, kv = layer(
                embeds, hidden, residual, rope, None if past is None else past[n], mask
            )
            new_kv.append(kv)
        assert residual is not None
        prenorm = hidden + residual
        normed = self.norm(prenorm)
        logits = self.lm_head(normed)
        if self.spec.logit_scale != 1.0:
            logits = logits * self.spec.logit_scale
        return DraftStep(logits, normed if self.spec.norm_output else prenorm, new_kv)

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> Tensor:
        """Target id of every draft id, ascending."""
        return self.to_target_ids(torch.arange(self.spec.draft_vocab_size))


def chain_logits(
    draft: Eagle3Draft, aux_hidden_states: Tensor, input_ids: Tensor, num_steps: int
) -> list[Tensor]:
    """Draft logits of every anchor's chain at once, teacher-forced on ``input_ids``.

    aux_hidden_states [T, n_aux, H_t] and input_ids [T] of one sequence. Returns ``num_steps``
    tensors [T, V_draft]: entry j, row t is the draft's prediction of x_{t+2+j} at chain step j
    of the draft anchored at row t.

    Step 0 row t: target state of row t, token x_{t+1}, position t, attending to step-0 rows
    0..t. Step j row t: the step j-1 output of the same anchor, token x_{t+1+j}, position
    t+j, attending to step-0 rows 0..t plus its own chain's steps 1..j. That is the KV cache
    vLLM holds when it drafts token j+1 after the target verified x_0..x_{t+1} — with the
    chain fed the true tokens, i.e. conditioned on the earlier draft tokens being right.
    Row t of step j is meaningful when t + 1 + j <= T - 1; other rows run on padding.

    Autograd flows through it, so it doubles as a training forward.
    """
    seq_len = input_ids.shape[0]
    rows = torch.arange(seq_len)
    padded = torch.cat([input_ids.long(), input_ids.new_zeros(num_steps + 1).long()])
    causal = rows[None, :] <= rows[:, None]
    diagonal = torch.eye(seq_len, dtype=torch.bool)
    hidden = draft.combine(aux_hidden_states)
    past: list[KV] | None = None
    out: list[Tensor] = []
    for step in range(num_steps):
        mask = torch.cat([causal] + [diagonal] * step, dim=1)
        result = draft(hidden, padded[rows + 1 + step], rows + step, past, mask)
        out.append(result.logits)
        hidden = result.chain_hidden
        past = (
            result.kv
            if past is None
            else [KV.cat([p, n]) for p, n in zip(past, result.kv, strict=True)]
        )
    return out
