"""Fused MoE: the routed tokens of every expert through its SwiGLU in two grouped GEMMs.

Launch side (torch, no host sync, so a decode step stays graph-capturable): the (token,
pick) pairs sorted by expert and each expert's run padded to a multiple of ``BLOCK_M``
(vLLM's ``moe_align_block_size``), into a buffer sized for the worst case. Then
``_gate_up_kernel``: per block of one expert's pairs, gate and up over the hidden dim,
``silu(gate) * up`` stored by sorted position; ``_down_kernel``: the down projection times
each pair's routing weight, stored at the pair's (token, pick) row. The K picks of a
token are summed last. Each expert's weights are read once per block of its pairs: the
grouped-GEMM roofline is the bytes of the experts hit. Roundings follow
``kernels.reference_moe.fused_moe_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import dot_precision, interpreting, mma
from .reference_moe import fused_moe_reference, route

__all__ = ["fused_moe", "fused_moe_reference", "route", "align_pairs"]


def align_pairs(ids: torch.Tensor, num_experts: int, block_m: int):
    """(sorted pair rows [P] (T*K = padding), block expert [P // block_m] (-1: unused))
    with P = T*K + E*(block_m - 1) rounded up to block_m: every expert's pairs contiguous
    and starting on a block boundary."""
    pairs = ids.numel()
    flat = ids.reshape(-1).to(torch.int64)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    start_padded = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=ids.device) - start[sorted_experts]
    size = triton.cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((size,), pairs, dtype=torch.int32, device=ids.device)
    rows[start_padded[sorted_experts] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, size, block_m, device=ids.device)
    ends = torch.cumsum(padded, 0)
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, s_x, s_we, s_wn, s_o,
                    PAIRS: tl.constexpr, TOP_K: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(rows_ptr + offs_m)
        valid = rows < PAIRS
        token = (rows // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + expert * s_we
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            a = tl.load(x_ptr + token[:, None] * s_x + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            g = tl.load(w_base + cols[None, :] * s_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            u = tl.load(w_base + (cols[None, :] + N) * s_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g = acc_g + mma(a, g, PRECISION, UPCAST)
            acc_u = acc_u + mma(a, u, PRECISION, UPCAST)
        act = (acc_g / (1.0 + tl.exp(-acc_g))) * acc_u
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * s_o + cols[None, :],
                 act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(a_ptr, w_ptr, out_ptr, rows_ptr, block_expert_ptr, weight_ptr, s_a, s_we, s_wn,
                 s_o, PAIRS: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= 0:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = tl.load(rows_ptr + offs_m)
        valid = rows < PAIRS
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < H
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        w_base = w_ptr + expert * s_we
        for k0 in range(0, N, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < N
            a = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * s_a + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + cols[None, :] * s_wn + ks[:, None],
                        mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc = acc + mma(a, w, PRECISION, UPCAST)
        scale = tl.load(weight_ptr + rows, mask=valid, other=0.0).to(tl.float32)
        out = acc * scale[:, None]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * s_o + cols[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & col_ok[None, :])


def _blocks(pairs: int, n: int, h: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small M for decode-sized batches (few pairs an expert)."""
    block_m = 16 if pairs <= 1024 else 64
    return block_m, min(64, triton.next_power_of_2(max(n, h, 16))), 64


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H]; ``w13`` [E, 2N, H]; ``w2`` [E, H, N]; ``weights``/``ids`` [T, K]
    -> [T, H]: sum over picks of weight * down(silu(gate(x)) * up(x)) of the pick's expert."""
    t, h = x.shape
    e, two_n, _ = w13.shape
    n, k = two_n // 2, ids.shape[1]
    assert x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    pairs = t * k
    if pairs == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k = _blocks(pairs, n, h)
    rows, block_expert = align_pairs(ids, e, block_m)
    precision = dot_precision(x.dtype)  # fp32 stays exact; 16-bit runs the tensor cores
    act = torch.empty(rows.numel(), n, dtype=x.dtype, device=x.device)
    blocks = block_expert.numel()
    _gate_up_kernel[(blocks, triton.cdiv(n, block_n))](
        x, w13, act, rows, block_expert, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        PAIRS=pairs, TOP_K=k, N=n, H=h, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        UPCAST=interpreting(x),
    )
    out = torch.empty(pairs, h, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(h, block_n))](
        act, w2, out, rows, block_expert, weights.reshape(-1).contiguous(), act.stride(0),
        w2.stride(0), w2.stride(1), out.stride(0),
        PAIRS=pairs, N=n, H=h, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        UPCAST=interpreting(x),
    )
    return out.view(t, k, h).sum(dim=1, dtype=torch.float32).to(x.dtype)
