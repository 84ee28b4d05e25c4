"""The EAGLE-3 draft network (Llama-style or MLA), its training-time-test unroll and loss.

No I/O and no distributed code. Parameter names are the speculators / vLLM checkpoint names
(``fc``, ``layers.N.*``, ``norm``, ``lm_head``), so export is a rename-free copy.

Architecture (what vLLM's ``Eagle3LlamaForCausalLM`` computes at serving time):

- ``fc``: concat of the ``n_aux`` aux hidden states [n_aux·H] -> H (``norm_before_fc``
  first applies one RMSNorm over the concatenation, weight ``input_norm.weight``; EAGLE
  3.1's ``fc_norm`` instead one RMSNorm per aux state, weights ``fc_norm.{i}.weight``);
- layer 0: ``input_layernorm(embed(token))`` and ``hidden_norm(hidden)`` are concatenated
  to 2H for q/k/v; the residual is the raw hidden state, or the normed one with
  ``norm_before_residual``; then Llama attention + MLP with residuals;
- layers 1..: plain Llama decoder layers (H inputs);
- ``norm`` then ``lm_head`` over the draft vocabulary. The state fed to the next TTT step is
  the pre-norm output, or the normed one with ``norm_output``.

The MLA draft (``architecture="mla"``, vLLM's ``Eagle3DeepseekV2ForCausalLM``) is the same
network with DeepSeek's multi-head latent attention in place of Llama attention: layer 0's
q_a_proj and kv_a_proj_with_mqa read the 2H concatenation; RoPE is interleaved (GPT-J pairs)
on the rope slice only, one k_pe shared by all heads; the softmax scale is
(nope + rope)^-0.5, times mscale² under YaRN; the MLP is dense.

Frozen, taken from the target (never trained, never part of the resumable state):
``embed_tokens`` [V_target, H], ``verifier_norm`` [H] and ``verifier_lm_head``
[V_draft, H] — the target's lm_head rows of the draft vocabulary only, so the target's
full-vocabulary logits are never formed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eagle3_train.config.train_config import ObjectiveConfig
from eagle3_train.model.arch import DraftArch
from eagle3_train.model.attention import mm_f32
from eagle3_train.model.layers import MLP, LayerCache, RMSNorm, Rotary, rms_norm
from eagle3_train.model.llama_attention import Attention
from eagle3_train.model.loss import LOSS_EPS, TargetTopK, fused_linear_kl, step_accuracy
from eagle3_train.model.mla_attention import MLAAttention
from eagle3_train.model.recompute import run_layer
from eagle3_train.model.shift import Alignment, align

PLAIN_TTT = ObjectiveConfig(topk_weight=0.0)


class DecoderLayer(nn.Module):
    """Layer 0 takes concat(embed, hidden) [2H]; later layers are plain Llama layers."""

    def __init__(self, arch: DraftArch, index: int) -> None:
        super().__init__()
        self.first = index == 0
        self.recompute = False  # train.recompute (build.speed_up): recompute.run_layer
        self.norm_before_residual = arch.norm_before_residual
        H = arch.hidden_size
        attention = MLAAttention if arch.mla else Attention
        self.self_attn = attention(arch, 2 * H if self.first else H)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(H, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, arch.rms_norm_eps)
        if self.first:
            self.hidden_norm = RMSNorm(H, arch.rms_norm_eps)

    def forward(
        self,
        x: Tensor,
        embeds: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        cache: LayerCache,
        docs: Alignment,
    ) -> Tensor:
        if self.first:
            assert embeds is not None
            hidden = self.hidden_norm(x)
            residual = hidden if self.norm_before_residual else x
            attn_in = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        else:
            residual = x
            attn_in = self.input_layernorm(x)
        x = residual + self.self_attn(attn_in, cos, sin, cache, docs)
        return x + self.mlp(self.post_attention_layernorm(x))


class FinalNorm(RMSNorm):
    """The final RMSNorm (checkpoint name ``norm``). Called with the LM head's weight it is
    the fused LM-head loss over rows of its *input*, normed chunk by chunk inside the loss
    loop (``fused_linear_kl``'s ``norm``): no [T, H] normed copy, no eager norm. The call
    runs inside this module's forward, itself inside the LM head's, because ZeRO-3 gathers a
    module's parameters only during its own forward."""

    def forward(self, x: Tensor, head: Tensor | None = None, **loss: object) -> Tensor:  # type: ignore[override]
        if head is None:
            return super().forward(x)
        return fused_linear_kl(x, head, norm=(self.weight, self.eps), **loss)  # type: ignore[arg-type]


class DraftLMHead(nn.Module):
    """The draft LM head; its forward is the fused LM-head + KL so ZeRO-3 gathers the weight."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(
        self,
        h: Tensor,
        target_logp: Tensor | None = None,
        row_weights: Tensor | None = None,
        chunk: int = 1024,
        top: TargetTopK | None = None,
        objective: ObjectiveConfig = PLAIN_TTT,
        rows: Tensor | None = None,
        target_offset: int = 0,
        norm: FinalNorm | None = None,
    ) -> tuple[Tensor, ...]:
        """(logits, argmax) without a target; with one, ``fused_linear_kl``'s (loss, KL,
        argmax) over the rows ``rows`` of h, trained toward ``target_logp``'s rows
        ``rows + target_offset``, normed by ``norm`` first when it is given."""
        if target_logp is None or row_weights is None:
            logits = h @ self.weight.T
            return logits, logits.argmax(-1)
        loss = dict(
            target_logp=target_logp,
            row_weights=row_weights,
            chunk=chunk,
            top=top,
            divergence=objective.divergence,
            lk_eta=objective.lk_eta,
            rows=rows,
            target_offset=target_offset,
        )
        if norm is not None:
            return norm(h, self.weight, **loss)
        return fused_linear_kl(h, self.weight, **loss)  # type: ignore[arg-type]


class Eagle3Draft(nn.Module):
    def __init__(self, arch: DraftArch) -> None:
        super().__init__()
        self.arch = arch
        H = arch.hidden_size
        if not arch.mla and arch.num_attention_heads % arch.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {arch.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {arch.num_key_value_heads}"
            )
        if arch.fc_norm and arch.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are exclusive (two norms of fc's input)")
        if arch.norm_before_fc:
            self.input_norm = RMSNorm(arch.num_aux * H, arch.rms_norm_eps)
        if arch.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(H, arch.rms_norm_eps) for _ in range(arch.num_aux))
        self.fc = nn.Linear(arch.num_aux * H, H, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = FinalNorm(H, arch.rms_norm_eps)
        self.lm_head = DraftLMHead(H, arch.draft_vocab_size)
        self.rotary = Rotary(arch)
        # Frozen target pieces: buffers, so no optimizer, DDP bucket or ZeRO partition sees
        # them and no checkpoint stores them (they come from target_head.safetensors).
        self.register_buffer(
            "embed_tokens", torch.zeros(arch.target_vocab_size, H), persistent=False
        )
        self.register_buffer("verifier_norm", torch.ones(H), persistent=False)
        self.register_buffer(
            "verifier_lm_head", torch.zeros(arch.draft_vocab_size, H), persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Llama-style init (normal, std 0.02; norms at one)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        nn.init.normal_(self.lm_head.weight, std=0.02)

    @torch.no_grad()
    def load_target_head(
        self,
        embed_tokens: Tensor,
        norm_weight: Tensor,
        lm_head_draft_rows: Tensor,
        init_lm_head: bool = True,
    ) -> None:
        """Install the frozen target weights; the draft lm_head starts at the target's rows."""
        self.embed_tokens.copy_(embed_tokens)
        self.verifier_norm.copy_(norm_weight)
        self.verifier_lm_head.copy_(lm_head_draft_rows)
        if init_lm_head:
            self.lm_head.weight.copy_(lm_head_draft_rows)

    @torch.no_grad()
    def store_frozen_as(self, dtype: torch.dtype) -> None:
        """Keep the frozen target embedding and LM-head rows in ``dtype`` (bf16 under bf16
        training: the target's own dtype, half the memory; the norm weight stays float32)."""
        self.embed_tokens = self.embed_tokens.to(dtype)
        self.verifier_lm_head = self.verifier_lm_head.to(dtype)

    def target_log_probs(self, last_hidden: Tensor) -> tuple[Tensor, Tensor]:
        """(log softmax over the draft vocabulary of lm_head_rows(norm(last)), its argmax)."""
        if _target_distribution_impl is not target_distribution:
            torch._dynamo.maybe_mark_dynamic(last_hidden, 0)  # tokens vary; widths stay static
        with torch.no_grad():
            return _target_distribution_impl(
                last_hidden,
                self.verifier_norm,
                self.verifier_lm_head,
                self.arch.target_rms_norm_eps,
            )

    def fc_input(self, aux: Tensor) -> Tensor:
        """[T, n_aux, H] -> fc's input [T, n_aux·H]: concatenated, normed as the flags say."""
        if self.arch.fc_norm:
            aux = torch.stack([norm(aux[:, i]) for i, norm in enumerate(self.fc_norm)], dim=1)
        x = aux.reshape(aux.shape[0], -1)
        return self.input_norm(x) if self.arch.norm_before_fc else x

    def forward(
        self,
        aux_hidden: Tensor,  # [T, n_aux, H] (any float dtype)
        last_hidden: Tensor,  # [T, H] target layer N, pre-norm
        input_ids: Tensor,  # [T] long
        loss_mask: Tensor,  # [T] bool/uint8
        cu_seqlens: Tensor,  # [n+1] long
        ttt_steps: int,
        ttt_step_loss_decay: float = 1.0,
        alignment: Alignment | None = None,
        objective: ObjectiveConfig | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(loss, stats): stats [ttt_steps, NUM_STATS] float64 holds, per step, the decayed
        step loss, the KL sum, scored slots, fully-correct slots and the conditional
        denominator (``loss.unpack_stats`` names them). Plain
        tensors, so DDP/DeepSpeed hooks see them.

        ``alignment``: ``shift.align`` of this batch computed on the host and moved here (the
        trainer does so); without it, it is computed here, reading counts back to the host.
        ``objective``: train.objective; None = plain EAGLE-3 TTT (what speculators computes;
        the trainer passes the config's)."""
        T = input_ids.shape[0]
        obj = objective or PLAIN_TTT
        al = alignment or align(input_ids, loss_mask, cu_seqlens, ttt_steps)
        target_logp, target_ids = self.target_log_probs(last_hidden)
        target_top = TargetTopK.of(target_logp, obj.topk, obj.topk_weight)
        pdtype = self.fc.weight.dtype
        hidden = self.fc(self.fc_input(aux_hidden.to(pdtype)))
        caches = [LayerCache() for _ in self.layers]
        prev_correct = al.valid[0]
        device = hidden.device.type
        autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        rope_dtype = autocast or hidden.dtype  # RoPE in the dtype q and k are computed in
        weights = [cast_once(layer, autocast) for layer in self.layers]
        loss = hidden.new_zeros((), dtype=torch.float32)
        rows: list[Tensor] = []
        for k in range(ttt_steps):
            embeds = F.embedding(al.step_tokens[k], self.embed_tokens).to(hidden.dtype)
            cos, sin = self.rotary(al.positions + k, rope_dtype)
            x = hidden
            for i, layer in enumerate(self.layers):
                x = run_layer(
                    layer, weights[i], x, embeds if i == 0 else None, cos, sin, caches[i], al
                )
            # the final norm runs inside the LM head's chunk loop, unless the next step is fed
            # the normed state (norm_output): then it is formed once here for both
            hidden = self.norm(x) if self.arch.norm_output else x
            # Draft logits only for the rows that count (scored, or in the accuracy chain);
            # each is trained toward the target's row t+1+k (gathered chunk by chunk).
            loss_rows, valid = al.loss_rows[k], al.valid[k]
            decay = ttt_step_loss_decay**k
            denominator = al.num_scored[k] + LOSS_EPS
            row_w = valid[loss_rows].float() * (decay / denominator)
            step_loss, step_kl, preds = self.lm_head(
                hidden,
                target_logp,
                row_w,
                self.arch.loss_chunk,
                target_top,
                obj,
                rows=loss_rows,
                target_offset=1 + k,
                norm=None if self.arch.norm_output else self.norm,
            )
            loss = loss + step_loss
            with torch.no_grad():
                correct = torch.zeros(T, dtype=torch.bool, device=preds.device)
                correct[loss_rows] = preds == target_ids[loss_rows + 1 + k]
                full_correct, cond_total, prev_correct = step_accuracy(
                    correct, valid, al.in_doc[k], prev_correct
                )
                kl_sum = step_kl * (denominator / decay)
                parts = (step_loss.detach(), kl_sum, valid.sum(), full_correct, cond_total)
                rows.append(torch.stack([p.double() for p in parts]))
        return loss, torch.stack(rows)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


def cast_once(layer: nn.Module, dtype: torch.dtype | None) -> dict[str, Tensor]:
    """The layer's float32 GEMM weights (its nn.Linear weights) cast to autocast's ``dtype``
    once per step, for every TTT step to share; {} without autocast, or where the weights are
    stored in ``dtype`` already (DeepSpeed's bf16). Eager autocast caches such a cast itself,
    but its cache does not reach into a compiled layer: there each TTT call would cast every
    weight again and return float32 gradients, summed in float32 before the weight's one
    accumulation. With one shared copy the steps' gradients are summed in ``dtype`` and cast
    once, as under eager autocast. Norm weights stay float32 (the norms compute in it)."""
    if dtype is None:
        return {}
    return {
        f"{name}.weight": module.weight.to(dtype)
        for name, module in layer.named_modules()
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32
    }


def target_distribution(
    last_hidden: Tensor, norm_weight: Tensor, head: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """(log p [T, V_draft] float32, argmax [T]) of head(norm(last_hidden)): float32 also under
    autocast, the target distribution being the reference. With bf16 head rows the GEMM takes
    bf16 inputs with a float32 result, as the target computes its logits. Plain torch, so
    ``compile_target_distribution`` fuses the norm into one pass and the argmax into the
    softmax's."""
    with torch.autocast(last_hidden.device.type, enabled=False):
        normed = rms_norm(last_hidden, norm_weight, eps)
        logits = (
            mm_f32(normed.to(head.dtype), head.T) if head.dtype != normed.dtype else normed @ head.T
        )
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp, logp.argmax(-1)


_target_distribution_impl = target_distribution


def compile_target_distribution(enabled: bool) -> None:
    """train.compile: the target's log-probabilities ``torch.compile``d, or eager."""
    global _target_distribution_impl
    _target_distribution_impl = (
        torch.compile(target_distribution) if enabled else target_distribution
    )
