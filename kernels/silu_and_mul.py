"""SiLU-and-mul of the stacked gate/up projection: ``silu(gate) * up`` in one kernel.

Unfused that is a chunk, a SiLU and a product (two launches and an intermediate the size
of the MLP's hidden layer). Rounding follows the torch ops: SiLU computed in fp32 and
rounded to the input dtype, then the product rounded again
(``kernels.reference_fused.silu_and_mul``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference_fused import silu_and_mul as silu_and_mul_reference

__all__ = ["silu_and_mul", "silu_and_mul_reference"]


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, s_gu, s_o, WIDTH: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < WIDTH
    gate = tl.load(gu_ptr + row * s_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * s_gu + WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(gu_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * s_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None,
                 block: int = 1024) -> torch.Tensor:
    """``[..., 2 * I]`` (gate then up) -> ``[..., I]`` (into ``out`` when given)."""
    assert gate_up.shape[-1] % 2 == 0 and gate_up.stride(-1) == 1
    i = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * i)
    shape = (*gate_up.shape[:-1], i)
    if out is None:
        out = torch.empty(shape, dtype=gate_up.dtype, device=gate_up.device)
    assert out.shape == shape and out.is_contiguous()
    rows = gu.shape[0]
    if rows:
        block = min(block, triton.next_power_of_2(i))
        _silu_and_mul_kernel[(rows, triton.cdiv(i, block))](
            gu, out, gu.stride(0), i, WIDTH=i, BLOCK=block, num_warps=4 if block >= 512 else 1,
        )
    return out
