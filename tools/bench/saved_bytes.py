"""What the draft's step keeps for backward, per token per TTT step, by module.

A saved-tensors hook records every tensor autograd saves during one forward (each storage once,
parameters and buffers excluded), charged to the innermost module running; two sample lengths
are run and their difference divided by the extra tokens and the TTT steps, so costs that do
not grow with the sample (weights, their bf16 casts) drop out. Forward only: minutes on a CPU
even at the real draft shapes. What is alive but not saved for backward (the target's
log-probabilities, the layer caches' lists) is not counted here (RESOURCES.md adds it).

    uv run --frozen python tools/bench/saved_bytes.py --hidden 4096 --heads 32 --kv-heads 8 \\
        --intermediate 14336 --dtype bf16                          # Llama-3.1-8B draft shape
    uv run --frozen python tools/bench/saved_bytes.py --hidden 7168 --heads 64 --kv-heads 64 \\
        --intermediate 12288 --norm-before-residual --dtype bf16 --tokens 64,128   # Kimi's
"""

from __future__ import annotations

import argparse
import collections
import contextlib

import torch
from torch import nn

from eagle3_train.model.arch import DraftArch
from eagle3_train.model.draft import Eagle3Draft

TTT_STEPS = 3


def saved_by_module(model: Eagle3Draft, tokens: int, bf16: bool) -> collections.Counter:
    """Bytes saved for backward by one forward over one packed sample, per module name."""
    g = torch.Generator().manual_seed(0)
    H = model.arch.hidden_size
    aux = torch.randn(tokens, 3, H, generator=g).to(torch.bfloat16 if bf16 else torch.float32)
    last = torch.randn(tokens, H, generator=g)
    ids = torch.randint(0, model.arch.target_vocab_size, (tokens,), generator=g)
    mask, cu = torch.ones(tokens, dtype=torch.bool), torch.tensor([0, tokens])
    held = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    running, seen, saved = ["(model)"], set(), collections.Counter()

    def enter(module: nn.Module, args: object, name: str) -> None:
        running.append(name)

    def leave(module: nn.Module, args: object, output: object) -> None:
        running.pop()

    hooks = []
    for name, module in model.named_modules():
        if name and not isinstance(module, nn.ModuleList):
            hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: enter(m, a, n)))
            hooks.append(module.register_forward_hook(leave))

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen | held:
            seen.add(storage.data_ptr())
            saved[running[-1].removeprefix("layers.0.")] += storage.nbytes()
        return t

    precision = torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision:
        model(aux, last, ids, mask, cu, TTT_STEPS)
    for hook in hooks:
        hook.remove()
    return saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=None, help="default hidden // heads")
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--v-draft", type=int, default=32000)
    p.add_argument("--norm-before-residual", action="store_true")
    p.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    p.add_argument("--tokens", default="128,256", help="the two sample lengths")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    arch = DraftArch(
        hidden_size=args.hidden,
        num_aux=3,
        target_vocab_size=args.v_draft,  # the embedding's rows do not grow with the sample
        draft_vocab_size=args.v_draft,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim or args.hidden // args.heads,
        intermediate_size=args.intermediate,
        rms_norm_eps=1e-5,
        target_rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=5e5,
        attention="chunked",
        norm_before_residual=args.norm_before_residual,
    )
    model = Eagle3Draft(arch)
    bf16 = args.dtype == "bf16"
    if bf16:
        model.store_frozen_as(torch.bfloat16)
    model.lm_head.weight.requires_grad_(False)  # its gradient does not grow with the sample
    short, long = (int(n) for n in args.tokens.split(","))
    a, b = saved_by_module(model, short, bf16), saved_by_module(model, long, bf16)
    per = {k: (b[k] - a[k]) / (long - short) / TTT_STEPS for k in a.keys() | b.keys()}
    total, H = sum(per.values()), args.hidden
    print(f"saved for backward per token per TTT step: {total:,.0f} B = {total / H:.1f} x H")
    for name, size in sorted(per.items(), key=lambda kv: -kv[1]):
        if abs(size) >= 1:
            print(f"  {name:32s} {size:10,.0f} B {size / H:6.2f} x H {size / total:6.1%}")


if __name__ == "__main__":
    main()
