"""RMSNorm, optionally with the residual add before it, in one pass over each row.

Unfused, a bf16 RMSNorm is eight elementwise kernels (cast, square, mean, add, rsqrt,
mul, cast, mul) and the residual add a ninth; a decode step runs two per layer, each a
few microseconds of launch for a few kilobytes of data. Here one program reads a row once
and writes the normed row (and the new residual), rounding exactly where the torch ops
round (``kernels.reference_fused.rms_norm``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference_fused import rms_norm as rms_norm_reference

__all__ = ["rms_norm", "rms_norm_reference"]


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    s_x, s_r, s_o, s_ro, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * s_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_ro + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
             residual_out: torch.Tensor | None = None):
    """``norm(x)``, or ``(norm(x + residual), x + residual)``; x ``[..., N]`` with unit
    stride in its last dim. The result has the dtype torch's ``weight * x`` would;
    ``out``/``residual_out`` (contiguous, x's shape) receive it when given."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous() and x.stride(-1) == 1
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    if out is None:
        dtype = torch.promote_types(x.dtype, weight.dtype)
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    assert out.shape == x.shape and out.is_contiguous()
    out2 = out.view(-1, n)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        assert residual.stride(-1) == 1
        r2 = residual.reshape(-1, n)
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        assert residual_out.shape == x.shape and residual_out.is_contiguous()
        res_out = residual_out
        ro2 = res_out.view(-1, n)
    else:
        r2 = ro2 = x2  # never read: HAS_RES is off
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out2, ro2,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), eps,
            N=n, BLOCK=block, HAS_RES=residual is not None,
            num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1,
        )
    return out if residual is None else (out, res_out)
