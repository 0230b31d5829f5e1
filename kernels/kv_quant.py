"""fp8 (e4m3) KV with a power-of-two scale per (token, KV head): the torch reference.

A token's K (or V) of one head, ``x[D]``, is stored as ``fp8(x / 2^s)`` plus one byte,
the biased exponent ``s + 127`` (OCP MX's e8m0). ``s`` is the head's ``amax`` exponent
less 7, so ``|x / 2^s| < 256 <= 448`` (e4m3's largest normal): nothing saturates, and
since fp8 is a floating-point format its 3-bit relative precision holds at any scale.
Dividing and multiplying by a power of two are exact in fp32, so fp8's own rounding is
the only error (values under e4m3's smallest normal, below 2^-13 of the head's amax, are
flushed to zero: subnormal rounding is where the interpreter's and the GPU's fp8 casts
part ways), and dequantizing (``fp8 -> fp32 * 2^s``) is exact: the Triton kernels,
the ``torch`` backend and this reference agree bit for bit on what is stored and on every
dequantized value. The exponent comes from the float's bits (no log2), which the Triton
kernels compute the same way (kernels/store_kv.py).

A row holding a NaN or an infinity is stored as zeros with the exponent byte 255 (its
scale 2^128 is infinite): read in context it still poisons the attention (0 x inf), while
the value bytes of a cache never hold an e4m3 NaN, so a kernel may read slots past a
context unmasked (stale rows of a block's earlier owner included) and zero them by p = 0.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
# Keep amax / 2^s in [128, 256); exponents clamped so 2^s and 2^-s are normal fp32.
HEADROOM_BITS = 7
MIN_EXP, MAX_EXP = 1, 253
MIN_NORMAL = 2.0**-6  # e4m3's smallest normal; scaled values below it are stored as 0
NONFINITE_EXP = 255  # a row with a NaN or inf: zeros under an infinite scale

__all__ = ["FP8", "dequantize", "exp2_biased", "quantize"]


def exp2_biased(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32, built from its bits (exact)."""
    return (e.to(torch.int32) << 23).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (fp8 [..., D], biased exponent uint8 [...]) per row of D."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    e = ((amax.view(torch.int32) >> 23) & 0xFF) - HEADROOM_BITS
    e = e.clamp(MIN_EXP, MAX_EXP)
    inv = exp2_biased(254 - e)
    y = xf * inv[..., None]
    bad = ~torch.isfinite(xf).all(dim=-1)
    y = torch.where((y.abs() < MIN_NORMAL) | bad[..., None], 0.0, y)
    return y.to(FP8), torch.where(bad, NONFINITE_EXP, e).to(torch.uint8)


def dequantize(q: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """fp8 [..., D] and its exponents [...] (or [..., 1]) -> fp32 [..., D], exactly."""
    if e.dim() == q.dim():
        e = e[..., 0]
    return q.float() * exp2_biased(e)[..., None]
