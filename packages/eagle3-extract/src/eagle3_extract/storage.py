"""Storage encodings of hidden states: bf16 / fp16 / fp32, and fp8 e4m3 with per-token scales.

fp8 (schema convention): ``value = fp8 * scale`` with one float32 scale per token and layer,
``scale = max|x| / 448`` over the hidden dimension, so each row uses e4m3's full range. The
relative rounding error of e4m3 (3 mantissa bits) is at most 2^-4 of the value for normal
numbers, hence at most 2^-4 of the row's largest magnitude overall.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}
# Worst-case error of the storage encoding relative to a row's largest magnitude (round to
# nearest: half an ulp, i.e. 2^-(mantissa bits + 1)).
STORAGE_RELATIVE_ERROR = {
    "float32": 2.0**-24,
    "bfloat16": 2.0**-8,
    "float16": 2.0**-11,
    "fp8_e4m3": 2.0**-4,
}


@dataclass(frozen=True)
class Encoded:
    values: torch.Tensor  # [..., H] in the storage dtype
    scale: torch.Tensor | None  # [...] float32 (fp8 only)


def encode(states: torch.Tensor, storage_dtype: str) -> Encoded:
    """Encode float states ``[..., H]`` for storage."""
    if storage_dtype != "fp8_e4m3":
        return Encoded(states.to(TORCH_DTYPES[storage_dtype]).contiguous(), None)
    x = states.to(torch.float32)
    amax = x.abs().amax(dim=-1)
    # An all-zero row gets scale 1 (any scale reproduces zeros; 0 would divide by zero).
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Encoded(q.contiguous(), scale.contiguous())


def decode(values: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Stored values back to float32."""
    x = values.to(torch.float32)
    return x * scale.unsqueeze(-1) if scale is not None else x
