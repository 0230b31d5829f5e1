"""Causal prefill over the paged cache with K/V tiles loaded through TMA (Hopper).

The tiling is the pointer kernel's (prefill_attention.py): rows are query tokens times
the GQA group, heaviest causal tiles first, an unmasked loop below the diagonal and a
masked loop on it. Three things differ, each because the H200 measured it faster
(bench/KERNEL_NOTES.md):

- K/V tiles come through host tensor descriptors. With one page per block the cache is
  viewed as rows ``[num_blocks * H_kv * page, D]`` and a tile is one 2D box; with several
  pages per block it is viewed as ``[num_blocks * pages_per_block, H_kv, page, D]`` and a
  tile is one box of ``BLOCK_N // page`` pages of one head. Either needs the tile inside
  one block (``block_size % BLOCK_N == 0``) and contiguous caches.
- The unmasked loop is a ``tl.range`` with its own pipeline depth (``LOOP_STAGES``).
- The ``BLOCK_M`` rows are two halves that share every K/V tile, each with its own
  softmax state, so one half's softmax hides behind the other half's matmul.

Descriptor loads are not masked: tokens past the context inside the last tile are
dropped by the causal mask, and their V rows are zeroed (the cache tail may hold NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, dot_precision, interpreting, mma, prefill_shapes, prefill_tile

__all__ = ["BLOCK_M", "BLOCK_N", "prefill_attention_tma", "tma_kv_mode", "tma_supported"]

try:  # host-side descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None

# The measured best on the H200 (d128, GQA 32/8, 8K tokens): two 64-row halves over
# 64-token K/V tiles, 4 warps, a 3-stage loop.
BLOCK_M = 128
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
LOOP_STAGES = 3

PAGE_BOXES, ROW_BOXES = 1, 2  # KV_MODE: how a descriptor box covers one K/V tile


def tma_supported() -> bool:
    """This triton has host tensor descriptors."""
    return TensorDescriptor is not None


@triton.jit
def load_kv_tile(k_src, v_src, bt_row, n0, kvh, H_KV: tl.constexpr, PAGE: tl.constexpr,
                 PPB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 KV_MODE: tl.constexpr):
    """K and V of tokens n0 .. n0 + BLOCK_N of head ``kvh``: one descriptor box each."""
    blk = tl.load(bt_row + n0 // (PAGE * PPB))
    off = n0 % (PAGE * PPB)
    if KV_MODE == 1:
        page = blk * PPB + off // PAGE
        k = k_src.load([page, kvh, off % PAGE, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_src.load([page, kvh, off % PAGE, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        row = (blk * H_KV + kvh) * PAGE + off
        k = k_src.load([row, 0])
        v = v_src.load([row, 0])
    return k, v


@triton.jit
def attend_tile(q, k, v, m_i, l_i, acc, scale_log2, ok, pos, qpos, MASKED: tl.constexpr,
                DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One K/V tile of the online softmax for one row half; MASKED on the diagonal."""
    s = mma(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
    if MASKED:
        s = tl.where((pos[None, :] <= qpos[:, None]) & ok[None, :], s, float("-inf"))
        v = tl.where(ok[:, None], v, 0.0)  # unmasked loads: 0 * NaN would be NaN
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A padding row can see nothing in a diagonal tile: keep exp2 away from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def load_rows(q_ptr, q_start, q_len, base, mt, kvh, half, s_qt, s_qh, G: tl.constexpr,
              G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, HM: tl.constexpr,
              TOK: tl.constexpr):
    """Rows ``half * HM ..`` of query tile ``mt``: q, query positions, token row, head in
    the group, store mask."""
    rows = half * HM + tl.arange(0, HM)
    ti = mt * TOK + rows // G_PAD
    hh = rows % G_PAD
    d = tl.arange(0, BLOCK_D)
    io_mask = ((ti < q_len) & (hh < G))[:, None] & (d < D)[None, :]
    q_row = (q_start + ti).to(tl.int64)
    q = tl.load(q_ptr + (q_row * s_qt + (kvh * G + hh) * s_qh)[:, None] + d[None, :],
                mask=io_mask, other=0.0)
    return q, base + ti, q_row, hh, io_mask


@triton.jit
def store_rows(o_ptr, acc, l_i, q_row, hh, kvh, io_mask, s_ot, s_oh, G: tl.constexpr,
               BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = q_row * s_ot + (kvh * G + hh) * s_oh
    tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _prefill_tma_kernel(
    q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr,
    scale_log2, n_bh, n_m,
    s_qt, s_qh, s_ot, s_oh, s_bt,
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr,
    LOOP_STAGES: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M // G_PAD
    HM: tl.constexpr = BLOCK_M // 2
    mt, b, kvh, q_start, q_len, base, full_end, diag_end = prefill_tile(
        tl.program_id(0), n_bh, n_m, cu_ptr, lens_ptr, H_KV, TOK, BLOCK_N
    )
    q0, qp0, r0, hh0, io0 = load_rows(q_ptr, q_start, q_len, base, mt, kvh, 0, s_qt, s_qh,
                                      G, G_PAD, D, BLOCK_D, HM, TOK)
    q1, qp1, r1, hh1, io1 = load_rows(q_ptr, q_start, q_len, base, mt, kvh, 1, s_qt, s_qh,
                                      G, G_PAD, D, BLOCK_D, HM, TOK)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    m0 = tl.full([HM], float("-inf"), tl.float32)
    l0 = tl.zeros([HM], tl.float32)
    a0 = tl.zeros([HM, BLOCK_D], tl.float32)
    m1, l1, a1 = m0, l0, a0
    cols = tl.arange(0, BLOCK_N)
    for n0 in tl.range(0, full_end, BLOCK_N, num_stages=LOOP_STAGES):
        k, v = load_kv_tile(k_src, v_src, bt_row, n0, kvh, H_KV, PAGE, PPB, BLOCK_N, BLOCK_D,
                            KV_MODE)
        m0, l0, a0 = attend_tile(q0, k, v, m0, l0, a0, scale_log2, cols >= 0, cols, qp0,
                                 False, DOT_PREC, UPCAST)
        m1, l1, a1 = attend_tile(q1, k, v, m1, l1, a1, scale_log2, cols >= 0, cols, qp1,
                                 False, DOT_PREC, UPCAST)
    for n0 in range(full_end, diag_end, BLOCK_N):
        pos = n0 + cols
        ok = pos < diag_end
        k, v = load_kv_tile(k_src, v_src, bt_row, n0, kvh, H_KV, PAGE, PPB, BLOCK_N, BLOCK_D,
                            KV_MODE)
        m0, l0, a0 = attend_tile(q0, k, v, m0, l0, a0, scale_log2, ok, pos, qp0, True,
                                 DOT_PREC, UPCAST)
        m1, l1, a1 = attend_tile(q1, k, v, m1, l1, a1, scale_log2, ok, pos, qp1, True,
                                 DOT_PREC, UPCAST)
    store_rows(o_ptr, a0, l0, r0, hh0, kvh, io0, s_ot, s_oh, G, BLOCK_D)
    store_rows(o_ptr, a1, l1, r1, hh1, kvh, io1, s_ot, s_oh, G, BLOCK_D)


def tma_kv_mode(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int = BLOCK_N) -> int:
    """How descriptors cover a ``block_n``-token K/V tile of these caches: ``ROW_BOXES``
    (one page per block), ``PAGE_BOXES``, or 0 when no box is one tile."""
    _, ppb, _, page, d = k_cache.shape
    fits = (TensorDescriptor is not None and (page * ppb) % block_n == 0
            and d == triton.next_power_of_2(d) and k_cache.is_contiguous()
            and v_cache.is_contiguous())
    if not fits:
        return 0
    return ROW_BOXES if ppb == 1 else PAGE_BOXES


def kv_descriptors(k_cache, v_cache, block_n: int, mode: int):
    """The K and V descriptors for ``mode`` (``tma_kv_mode``'s answer, not 0)."""
    nb, ppb, h_kv, page, d = k_cache.shape
    if mode == ROW_BOXES:
        shape, strides, box = [nb * h_kv * page, d], [d, 1], [block_n, d]
    else:
        shape = [nb * ppb, h_kv, page, d]
        strides = [h_kv * page * d, page * d, d, 1]
        box = [max(1, block_n // page), 1, min(page, block_n), d]
    return (TensorDescriptor(k_cache, shape, strides, box),
            TensorDescriptor(v_cache, shape, strides, box))


def prefill_attention_tma(
    q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, *,
    max_seqlen_q=None, block_m=BLOCK_M, block_n=BLOCK_N, num_warps=NUM_WARPS,
    num_stages=NUM_STAGES, loop_stages=LOOP_STAGES, out=None,
):
    """Same contract as ``prefill_attention.prefill_attention``; the caches must take
    descriptors (``tma_kv_mode(...) != 0``). The tile keywords exist for tests and
    the bench sweep; the defaults are the measured best."""
    mode = tma_kv_mode(k_cache, v_cache, block_n)
    if mode == 0:
        raise ValueError(f"no TMA box covers a {block_n}-token tile of a cache shaped "
                         f"{tuple(k_cache.shape)} (contiguous={k_cache.is_contiguous()}); "
                         "use prefill_attention (pointer loads) for it")
    t, _, d, ppb, h_kv, page, bsz, max_seqlen_q, group, g_pad = prefill_shapes(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, max_seqlen_q
    )
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or bsz == 0:
        return out
    block_m = max(block_m, 2 * g_pad, 32)
    k_src, v_src = kv_descriptors(k_cache, v_cache, block_n, mode)
    n_m = triton.cdiv(max_seqlen_q, block_m // g_pad)
    _prefill_tma_kernel[(n_m * bsz * h_kv,)](
        q, k_src, v_src, cu_seqlens_q, context_lens, block_tables, out,
        scale * LOG2E, bsz * h_kv, n_m,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        H_KV=h_kv, G=group, G_PAD=g_pad, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PAGE=page, PPB=ppb, BLOCK_M=block_m, BLOCK_N=block_n, KV_MODE=mode,
        LOOP_STAGES=loop_stages, DOT_PREC=dot_precision(q.dtype), UPCAST=interpreting(q),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
