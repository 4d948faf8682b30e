"""The frame cache's FP8 rows in torch ops, for the drop-in's writes and reads.

The rule is ``jaxkv.formats.quantize_fp8_rows``'s (its docstring says why this scale): one
bfloat16 scale per token and head, ``amax / 448`` rounded up to a bfloat16, the codes
E4M3 rounded to nearest even. The drop-in writes K/V with torch ops, without a JAX dispatch
per frame, so the rule is repeated here and a test holds the bytes equal to jaxkv's on
random rows, zero rows and non-finite rows (tests/torch_bridge/test_dropin_fp8.py).
"""

from __future__ import annotations

import torch

from jaxkv.formats.numerics import FP8_MAX


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: float[..., d] -> (codes float8_e4m3fn[..., d], scale bf16[...]).

    A row holding a NaN or an infinity gets a NaN scale and zero codes (it dequantizes to
    NaN), an all-zero row a zero scale; nothing is clipped: ``|x| / scale <= 448``."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)  # NaN wherever the row holds a NaN
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its rounded
    # reciprocal, which moves the scale by a bfloat16 step where amax / 448 is one exactly.
    bits = (amax / torch.full_like(amax, FP8_MAX)).view(torch.int32)  # amax within bf16's range
    up = ((bits + 0xFFFF) & -0x10000).view(torch.float32)  # rounded up to a bfloat16
    scale = torch.where(torch.isfinite(amax), up, torch.nan)
    keep = scale > 0
    safe = torch.where(keep, scale, 1.0)
    codes = torch.where(keep[..., None], xf / safe[..., None], 0.0).to(torch.float8_e4m3fn)
    return codes, scale.to(torch.bfloat16)


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """codes float8_e4m3fn[..., d], scale bf16[...] -> dtype[..., d]."""
    return (codes.float() * scale.float()[..., None]).to(dtype)
