"""THE shift (shift.align) on a hand-built batch, and proof that the training forward computes
what vLLM's EagleProposer computes at serving time.

Serving (vllm/v1/spec_decode/eagle.py, propose): token ids are shifted left by one and paired
with the target hidden states of the same rows at the rows' own positions; the last row's
token is the one just sampled. Each further draft step feeds back the draft's pre-norm
output with the next token at position + 1, attending to the context's cached step-0 keys and
the chain's own earlier keys. ``serve`` below re-implements that loop independently (dense
float64 attention over an explicit KV cache) and must give the same logits as the TTT
training forward at every slot and step.
"""

from __future__ import annotations

import pytest
import torch

from eagle3_train.model.draft import Eagle3Draft
from eagle3_train.model.layers import RMSNorm, apply_rope
from eagle3_train.model.shift import align

from support.train import small_arch


def test_alignment_on_hand_built_batch():
    ids = torch.tensor([10, 11, 12, 13, 20, 21, 22])
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    cu = torch.tensor([0, 4, 7])
    al = align(ids, mask, cu, ttt_steps=2)
    assert al.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert al.doc_start.tolist() == [0, 0, 0, 0, 4, 4, 4]
    # step 0: slot t is fed x_{t+1} and scored at loss_mask[t+1] inside its document
    assert al.step_tokens[0].tolist() == [11, 12, 13, 20, 21, 22, 0]
    assert al.in_doc[0].tolist() == [True, True, True, False, True, True, False]
    assert al.valid[0].tolist() == [True, True, True, False, True, True, False]
    # step 1: fed x_{t+2}; slot 2 would need row 4 (next document): not scored
    assert al.step_tokens[1].tolist() == [12, 13, 20, 21, 22, 0, 0]
    assert al.valid[1].tolist() == [True, True, False, False, True, False, False]


def test_prompt_tokens_are_not_scored_but_the_first_answer_continuation_is():
    # prompt x0..x2, answer x3..x5: the draft runs once the target produced x3 (slot 2)
    mask = torch.tensor([0, 0, 0, 1, 1, 1], dtype=torch.bool)
    al = align(torch.arange(6), mask, torch.tensor([0, 6]), ttt_steps=1)
    assert al.valid[0].tolist() == [False, False, True, True, True, False]


def _tiny(norm_output: bool) -> Eagle3Draft:
    arch = small_arch(
        target_vocab_size=30,
        draft_vocab_size=30,
        target_rms_norm_eps=1e-6,
        max_position_embeddings=128,
        norm_output=norm_output,
    )
    torch.manual_seed(0)
    model = Eagle3Draft(arch)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g) + (1.0 if p.dim() == 1 else 0.0))
    model.load_target_head(
        torch.randn(30, 16, generator=g),
        torch.ones(16),
        torch.randn(30, 16, generator=g),
        init_lm_head=False,
    )
    return model.double()


def _layer(model, x_hidden, embeds, positions, cache_k, cache_v):
    """Layer 0 on rows given positions; queries attend to the cache plus their own new keys."""
    layer = model.layers[0]
    hidden = layer.hidden_norm(x_hidden)
    residual = x_hidden
    attn_in = torch.cat([layer.input_layernorm(embeds), hidden], -1)
    a = layer.self_attn
    n = attn_in.shape[0]
    q = a.q_proj(attn_in).view(n, a.nh, a.d).transpose(0, 1)
    k = a.k_proj(attn_in).view(n, a.nkv, a.d).transpose(0, 1)
    v = a.v_proj(attn_in).view(n, a.nkv, a.d).transpose(0, 1)
    cos, sin = model.rotary(positions, torch.float64)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    keys, vals = torch.cat([cache_k, k], 1), torch.cat([cache_v, v], 1)
    g = a.nh // a.nkv
    scores = q @ keys.repeat_interleave(g, 0).transpose(-1, -2) / a.d**0.5
    past = cache_k.shape[1]
    causal = torch.arange(past + n)[None, :] <= (past + torch.arange(n))[:, None]
    out = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ vals.repeat_interleave(
        g, 0
    )
    x = residual + a.o_proj(out.transpose(0, 1).reshape(n, -1))
    x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, keys, vals


def serve(model, aux, ids, t, steps):
    """vLLM's draft for context rows 0..t (teacher-forced chain): logits of each draft step."""
    with torch.no_grad():
        empty = torch.zeros(2, 0, 8, dtype=torch.float64)
        # prefill: rows 0..t, hidden fc(aux[j]) with token x_{j+1} at position j
        hidden = model.fc(aux[: t + 1].reshape(t + 1, -1))
        embeds = model.embed_tokens[ids[1 : t + 2]]
        x, keys, vals = _layer(model, hidden, embeds, torch.arange(t + 1), empty, empty)
        out = []
        h = x[-1:]
        for k in range(steps):
            normed = model.norm(h)
            out.append((normed @ model.lm_head.weight.T)[0])
            if k + 1 == steps:
                break
            fed = normed if model.arch.norm_output else h
            token = ids[t + 2 + k : t + 3 + k]
            h, keys, vals = _layer(
                model, fed, model.embed_tokens[token], torch.tensor([t + 1 + k]), keys, vals
            )
        return out


@pytest.mark.parametrize("norm_output", [False, True])
def test_training_forward_equals_vllm_style_serving(norm_output):
    model = _tiny(norm_output)
    T, steps = 14, 3
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(T, 3, 16, generator=g, dtype=torch.float64)
    last = torch.randn(T, 16, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 30, (T,), generator=g)
    captured = []
    # the final norm of each step's state (the fused LM head norms it inside its loop)
    hook = model.norm.register_forward_hook(
        lambda m, i, o: captured.append(RMSNorm.forward(m, i[0]).detach())
    )
    model(aux, last, ids, torch.ones(T, dtype=torch.bool), torch.tensor([0, T]), ttt_steps=steps)
    hook.remove()
    train_logits = [c @ model.lm_head.weight.T for c in captured]  # per step [T, V]
    for t in range(0, T - steps - 1, 3):
        for k, logits in enumerate(serve(model, aux, ids, t, steps)):
            torch.testing.assert_close(train_logits[k][t], logits, rtol=1e-9, atol=1e-9)
