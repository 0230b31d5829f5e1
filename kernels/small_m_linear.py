"""fp32 ``x @ w.T (+ b)`` for a handful of rows, in exact fp32 (no TF32).

A drafted decode step in fp32 multiplies 2-16 rows (the verify's k+1 tokens, the drafter's
block) by each weight. cuBLAS sends many such shapes to a SIMT fp32 GEMM that took ~31 us
per call on an H200 (22 per drafted step, 0.70 of its 1.50 ms: bench/RESULTS.md, "Where a
drafted step's time goes"), while one row takes its 3 us gemv path. Here each program
keeps a 16-column weight tile in registers and reduces every row against it by fp32 FMA
(no dot, so no TF32): the same products as ``F.linear`` in another order, so greedy tokens
keep the tolerance the lossless tests give any two fp32 GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["MAX_ROWS", "ROW_CLASSES", "row_class", "small_m_linear", "small_m_linear_reference", "wins"]

# Where it beats cuBLAS (scripts/kernel_bench/small_m_micro.py --sweep, one H200, in CUDA
# graphs, 8 rows): 3.4-4.1 us against cuBLAS's 24-52 us at N 128-768 x K 256-768, 4.4
# against 7.0 us at N 256 x K 1024; cuBLAS wins from N 1024 at K 256 (2.9-3.3 us against
# 3.7-3.8).
MAX_ROWS = 16
MAX_K = 1024
MAX_N = 1023
# One row count per compiled row class (BLOCK_M, the rows rounded up to a power of two;
# ``rows`` itself is not specialized): what a warm-up runs to meet them all ahead.
ROW_CLASSES = (2, 4, 8, 16)


def row_class(rows: int) -> int:
    """The kernel's BLOCK_M for this many rows: one compiled specialization each."""
    return triton.next_power_of_2(rows)


def wins(rows: int, n: int, k: int) -> bool:
    """Whether this kernel, not cuBLAS, should take an fp32 product of this shape."""
    return 1 < rows <= MAX_ROWS and n <= MAX_N and k <= MAX_K


@triton.jit(do_not_specialize=["rows"])
def _small_m_rows_kernel(x_ptr, w_ptr, b_ptr, out_ptr, rows, s_x, s_w, s_o,
                         N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """No dot: the program's [BLOCK_N, K] weight slice is loaded once and each row is a
    multiply and a reduction over K against it (fp32 FMA by construction)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + cols[:, None] * s_w + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
    bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0) if HAS_BIAS else tl.zeros((BLOCK_N,), tl.float32)
    for m in tl.static_range(BLOCK_M):
        if m < rows:
            x = tl.load(x_ptr + m * s_x + k, mask=k < K, other=0.0)
            tl.store(out_ptr + m * s_o + cols, tl.sum(w * x[None, :], axis=1) + bias, mask=cols < N)


def columns_per_program(n: int) -> int:
    """One column a program up to N 512, two above: a 256-column product as 16 programs of
    16 columns left most of the GPU idle (11.5 us at K 768 on the H200; 4.1 us as 256
    programs of one column, bench/KERNEL_NOTES.md row 50)."""
    return 1 if n <= 512 else 2


def warps_for(k: int) -> int:
    """One warp reduces a row of up to 768 weights fastest (H200 sweep); four from K 1024."""
    return 1 if k <= 768 else 4


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   *, block_n: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``F.linear`` for fp32 ``x [..., K]`` with at most ``MAX_ROWS`` rows and ``weight
    [N, K]`` (rows contiguous); ``block_n`` and ``num_warps`` are for the micro's sweep."""
    n, k_dim = weight.shape
    assert x.dtype == weight.dtype == torch.float32 and x.shape[-1] == k_dim and weight.stride(1) == 1
    flat = x.reshape(-1, k_dim)
    if flat.stride(0) != k_dim or flat.stride(1) != 1:  # one stride class per weight
        flat = flat.contiguous()
    rows = flat.shape[0]
    assert rows <= MAX_ROWS, f"{rows} rows: small_m_linear takes at most {MAX_ROWS}"
    out = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    if rows:
        block_n = block_n or columns_per_program(n)
        _small_m_rows_kernel[(triton.cdiv(n, block_n),)](
            flat, weight, bias if bias is not None else weight, out, rows, flat.stride(0), weight.stride(0),
            out.stride(0), N=n, K=k_dim, HAS_BIAS=bias is not None, BLOCK_M=row_class(rows),
            BLOCK_N=block_n, BLOCK_K=max(16, triton.next_power_of_2(k_dim)), num_warps=num_warps or warps_for(k_dim))
    return out.reshape(*x.shape[:-1], n)


def small_m_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """The oracle: the product in fp64, rounded to fp32 once."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out = out + bias.double()
    return out.float()
