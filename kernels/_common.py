"""Small pieces shared by the attention kernels."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def interpreting(t: torch.Tensor) -> bool:
    """True when kernels run under TRITON_INTERPRET (CPU tensors)."""
    return not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get an exact dot (tf32 would cost ~1e-3 relative); 16-bit ignore it."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


@triton.jit
def mma(a, b, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot`` with fp32 accumulation. UPCAST feeds fp32 operands, for the CPU
    interpreter, whose 16-bit ``tl.dot`` returns garbage (seen with triton 3.9)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def page_offsets(bt_row_ptr, pos, valid, kvh, s_cb, s_cp, s_ch, s_ct,
                 PAGE: tl.constexpr, PPB: tl.constexpr):
    """Element offset of (token ``pos``, KV head ``kvh``) in a paged head-major cache,
    via the sequence's block table row: page ``block * PPB + off // PAGE``."""
    blk = tl.load(bt_row_ptr + pos // (PAGE * PPB), mask=valid, other=0).to(tl.int64)
    off = pos % (PAGE * PPB)
    return blk * s_cb + (off // PAGE) * s_cp + kvh * s_ch + (off % PAGE) * s_ct
