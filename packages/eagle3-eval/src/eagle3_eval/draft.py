"""The EAGLE-3 draft at inference time, written from vLLM's semantics and independent of the
trainer's layers (eagle3_train/model/layers.py) on purpose: it exists to catch their bugs, so the
two share no code; two implementations that agree are the evidence.

This is an independent reading of the speculators ``eagle3`` checkpoint format (config.json +
model.safetensors) and of what vLLM 0.32 computes with it (``model_executor/models/
llama_eagle3.py``, ``transformers_utils/configs/speculators/algos.py``,
``v1/spec_decode/llm_base_proposer.py``). A draft that scores the same here and in vLLM proves
format and alignment; a disagreement is a finding. The layers are in ``draft_layers``; this
module composes them into the draft and its chain.

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

from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from eagle3_eval.draft_layers import (
    KV,
    DraftLayer,
    DraftStep,
    MLADraftLayer,
    MLARotaryEmbedding,
    RMSNorm,
)
from eagle3_eval.draft_spec import (
    WEIGHTS_FILE,
    DraftFormatError,
    DraftSpec,
    checkpoint_names,
    read_spec,
)


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
