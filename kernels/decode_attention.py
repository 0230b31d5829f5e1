"""Paged decode attention: split-K flash-decoding over the head-major paged cache.

One program per (sequence, KV head, split) reads that head's pages in place and
serves every query head of its GQA group (and, for DSpark blocks, every block
position) as rows of one ``tl.dot``, so each KV byte is read once per step. The
(sequence, KV head) pair is grid axis 0 (no 65535 cap); splits are axis 1. Each
sequence's tokens are cut into ``num_splits`` equal chunks *inside* the kernel, so the
launch needs no host read of the context lengths (CUDA-graph friendly); with more
than one split a small reduction pass merges the partial softmaxes. The same kernel
optionally appends ``NX`` per-sequence tokens held outside the cache (the DSpark
block, see block_attention.py): the last split attends to them in one extra tile after
its context loop, so the context loop is exactly the decode loop (mixing the block
tokens into every tile costs 1.8x a decode step on the H200: bench/KERNEL_NOTES.md).
A 16-bit context loop does the least per score element: no token masks on its loads and
no select on its scores except in a split's partial last tile (its tokens past the end
re-read the last real one), and the running max kept on the raw dot so that the softmax
scale folds into one FMA with the max's subtraction (the DSpark block pass, 32 rows where
a decode has 4, ran 1.04-1.06x faster at d128 and 1.07-1.10x at d64 on the H200:
bench/KERNEL_NOTES.md row 51). An fp8 cache (``k_scale``/``v_scale`` given) is only
converted (e4m3 is exact in 16 bits;
a bf16 q goes to fp16 for the dots, since e4m3 -> fp16 is one instruction per two values
and -> bf16 two), K loaded transposed so its tile feeds the dot as the 16-bit path's does,
V from its transposed head pages ([D, page], kernels/reference.py: the PV dot's operand
needs no byte-wise transpose in shared memory; 1.3-1.9x V stored [page, D] on the H200,
bench/KERNEL_NOTES.md), read a page at a time when pages are shorter than the tile
(``V_PAGES``: [pages, D, page], so a warp reads a page's rows whole; 1.2-1.26x the tile's
[tokens, D] read at page 16 on the H200), and then K too ([pages, page, D], from the same
block-table read per page) with no token mask and the 16-bit loop's branch-only select
(1.08-1.13x at page 16 on the H200, row 53); pages as long as the tile are read so too,
one page a tile at two warps and three stages (1.07-1.14x K per token with its masks at
four warps at page 128, row 54); each token-head's power-of-two scale (its byte exponent,
kernels/kv_quant.py) is applied to the score and p columns instead of every element: the
same products. The scale bytes are read a page row at a time, a tile ahead
(1.17-1.24x the per-element dequantization on the H200: bench/RESULTS.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    dot_precision,
    interpreting,
    kv_scales,
    mma,
    page_offsets,
    row_scales,
    scale_rows,
    scales_of,
    sm_count,
)
from .reference import decode_attention as decode_attention_reference

__all__ = ["decode_attention", "decode_attention_reference", "paged_attention"]

@triton.jit
def _softmax_step(s, m_i, l_i, c, SCALED: tl.constexpr):
    """The online softmax over one tile's scores ``s`` (masked columns -inf): (m, l, p,
    alpha). A 16-bit tile's ``s`` is the raw dot and ``m`` its running max, not the scaled
    score's: ``c = scale * log2(e) > 0`` commutes with the max, so p = exp2(s * c - m * c)
    is one FMA an element where scaling first was a multiply and a subtract. ``SCALED`` (an
    fp8 tile, whose per-column scales multiply every score anyway): ``s`` and ``m`` are
    already in log2 units (``c`` folded into the column scales). Every tile has a valid
    column, so the running max is finite."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SCALED:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    else:
        mc = m_new * c
        alpha = tl.exp2(m_i * c - mc)
        p = tl.exp2(s * c - mc[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, p, alpha


@triton.jit
def _online_step(q, k, v, ok, m_i, l_i, acc, c, SCALED: tl.constexpr, DOT_PREC: tl.constexpr,
                 UPCAST: tl.constexpr):
    """One masked K/V tile of the online softmax (the DSpark block's own tokens), in the
    context loop's units (``SCALED``: an fp8 cache's)."""
    s = mma(q, tl.trans(k), DOT_PREC, UPCAST)
    if SCALED:
        s = s * c
    s = tl.where(ok[None, :], s, float("-inf"))
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, c, SCALED)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
    return m_i, l_i, acc


@triton.jit
def _online_step_fp8(q, k_t, v, sk, sv, ok, partial, m_i, l_i, acc, scale_log2, DOT_PREC: tl.constexpr,
                     UPCAST: tl.constexpr):
    """``_online_step`` over an fp8 tile: ``k_t`` [D, N] and ``v`` [N, D] only converted
    (e4m3 is exact in 16 bits), their power-of-two scales ``sk``/``sv`` [N] applied to the
    score and p columns instead of every element: the same products, since scaling by a
    power of two is exact in fp32 and commutes with rounding to 16 bits. K comes already
    transposed (loaded as [D, N]), so no 8-bit transpose goes through shared memory. The
    scores are in log2 units (``scale_log2`` folded into the column scales); ``partial``
    (a tile running past ``end``, or every tile where K is loaded with token masks) selects
    -inf past ``end``. Read a page at a time (the default), it is what lets K skip the
    per-token offsets (bench/KERNEL_NOTES.md rows 53-54); K read per token (``v_pages=False``)
    keeps its masks: unmasked there at four warps, ptxas gave it 141-150 registers at page
    128 against 121 and it measured no gain (row 51)."""
    s = mma(q, k_t, DOT_PREC, UPCAST) * (sk * scale_log2)[None, :]
    if partial:  # columns past ``end`` (their K may be stale bytes): -inf
        s = tl.where(ok[None, :], s, float("-inf"))
    m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, scale_log2, True)
    acc = acc * alpha[:, None] + mma((p * sv[None, :]).to(v.dtype), v, DOT_PREC, UPCAST)
    return m_i, l_i, acc


# The block table's row stride grows with the longest context in a step: specialized on
# (1, a multiple of 16, other) it would compile anew inside requests that no warm-up step
# foresaw; it only indexes scalar loads, so it is not specialized.
@triton.jit(do_not_specialize=["s_bt"])
def _paged_split_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, kx_ptr, vx_ptr, lens_ptr, bt_ptr, o_ptr, ml_ptr,
    scale_log2,
    s_qb, s_qm, s_qh,
    s_xb, s_xm, s_xh,
    s_cb, s_cp, s_ch, s_ct,
    s_sb, s_sp, s_sh,
    s_bt,
    s_ob, s_os, s_om, s_oh,
    s_mb, s_ms, s_mm, s_mh,
    H_KV: tl.constexpr, NQ: tl.constexpr, NX: tl.constexpr,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_X: tl.constexpr,
    SPLITS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
    SW: tl.constexpr, F8_F16: tl.constexpr, V_PAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid // H_KV).to(tl.int64)
    kvh = pid % H_KV
    ctx = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)

    rows = tl.arange(0, BLOCK_M)
    qi = rows // G_PAD
    qh = kvh * G + rows % G_PAD
    row_ok = (qi < NQ) & (rows % G_PAD < G)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = b * s_qb + qi * s_qm + qh * s_qh
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b * s_bt
    if QUANT:  # scale bytes a tile ahead, their blocks two ahead (plain loads, by hand)
        blk_next = scale_rows(bt_row, start, end, PAGE, PPB, BLOCK_N, SW)
        ek_next = row_scales(ks_ptr, blk_next, start, kvh, s_sb, s_sp, s_sh, PAGE, PPB, BLOCK_N, SW)
        ev_next = row_scales(vs_ptr, blk_next, start, kvh, s_sb, s_sp, s_sh, PAGE, PPB, BLOCK_N, SW)
        blk_next = scale_rows(bt_row, start + BLOCK_N, end, PAGE, PPB, BLOCK_N, SW)
        # fp16 dots: e4m3 -> fp16 is one cvt per two values (-> bf16 takes a second)
        q8 = q.to(tl.float16) if F8_F16 else q
    # The paged context: the same loop as plain decode (loads straight into the dot). A
    # 16-bit tile's loads take no token mask and a full tile's scores no select: only a
    # split's last tile can run past ``end``, and it alone masks its scores (a branch the
    # whole program takes or skips); its tokens past ``end`` re-read token ``end - 1`` (a
    # real one: no stale NaN can meet p = 0 in the PV dot). With the FMA-folded scale
    # (``_softmax_step``) the DSpark block pass's loop runs 1.04-1.05x faster at d128
    # (bench/KERNEL_NOTES.md row 51). An fp8 tile read a page at a time does the same
    # (row 53); one read per token keeps its masks (below).
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        if QUANT:
            ek = ek_next
            ev = ev_next
            ek_next = row_scales(ks_ptr, blk_next, n0 + BLOCK_N, kvh, s_sb, s_sp, s_sh, PAGE, PPB, BLOCK_N, SW)
            ev_next = row_scales(vs_ptr, blk_next, n0 + BLOCK_N, kvh, s_sb, s_sp, s_sh, PAGE, PPB, BLOCK_N, SW)
            blk_next = scale_rows(bt_row, n0 + 2 * BLOCK_N, end, PAGE, PPB, BLOCK_N, SW)
            sk = scales_of(ek, ok, BLOCK_N)
            sv = scales_of(ev, ok, BLOCK_N)
            # V's head page is stored [D, PAGE]: a column of V is PAGE contiguous tokens.
            # No token mask (it would split the contiguous runs) and no zeroing (an
            # elementwise op on V sends the tile through shared memory again in 16 bits):
            # a token past the context reads a real page whose bytes the writer never
            # leaves NaN (kv_quant), and its p is exactly 0.
            if V_PAGES:
                # Pages no longer than the tile: K as [pages, PAGE, D] and V as [pages, D, PAGE]
                # from one block-table read per page (not per token), a page's rows whole;
                # pages past ``end`` re-read the last one, K's tokens past it are unmasked
                # and only a split's partial last tile selects its scores (as the 16-bit
                # loop): 0.78x the loop's instructions at page 16 (bench/KERNEL_NOTES.md row 53).
                first = tl.minimum(n0 + tl.arange(0, BLOCK_N // PAGE) * PAGE, (end - 1) // PAGE * PAGE)
                start_t = tl.multiple_of(page_offsets(bt_row, first, None, kvh, s_cb, s_cp, s_ch, s_ct,
                                                      PAGE, PPB), PAGE)
                in_page = tl.arange(0, PAGE)
                k3 = tl.load(kc_ptr + start_t[:, None, None] + in_page[None, :, None] * s_ct + d[None, None, :],
                             mask=d_ok[None, None, :], other=0.0)
                k_t = tl.trans(tl.reshape(k3, (BLOCK_N, BLOCK_D)))
                v3 = tl.load(vc_ptr + start_t[:, None, None] + d[None, :, None] * PAGE + in_page[None, None, :],
                             mask=d_ok[None, :, None], other=0.0)
                v = tl.reshape(tl.permute(v3, (0, 2, 1)), (BLOCK_N, BLOCK_D))
                partial = n0 + BLOCK_N > end
            else:
                tok = page_offsets(bt_row, pos, ok, kvh, s_cb, s_cp, s_ch, s_ct, PAGE, PPB)
                k_t = tl.load(kc_ptr + tok[None, :] + d[:, None], mask=d_ok[:, None] & ok[None, :], other=0.0)
                # Written out, not _common.v_column: through the call, triton 3.6 lost these
                # hints and read V a byte at a time (2.5-3x slower on the H200).
                t_in = pos % PAGE
                v_col = tl.max_contiguous(tl.multiple_of(tok - t_in * s_ct + t_in, SW), SW)
                v = tl.load(vc_ptr + v_col[:, None] + d[None, :] * PAGE, mask=d_ok[None, :], other=0.0)
                partial = True
            m_i, l_i, acc = _online_step_fp8(q8, k_t.to(q8.dtype), v.to(q8.dtype), sk, sv, ok, partial, m_i, l_i,
                                             acc, scale_log2, DOT_PREC, UPCAST)
        else:
            tok = page_offsets(bt_row, tl.minimum(pos, end - 1), None, kvh, s_cb, s_cp, s_ch, s_ct, PAGE, PPB)
            k = tl.load(kc_ptr + tok[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(vc_ptr + tok[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
            s = mma(q, tl.trans(k), DOT_PREC, UPCAST)
            if n0 + BLOCK_N > end:  # the split's partial last tile
                s = tl.where(ok[None, :], s, float("-inf"))
            m_i, l_i, p, alpha = _softmax_step(s, m_i, l_i, scale_log2, False)
            acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
    # The DSpark block's own K/V (not in the cache): once, by the last split, after the
    # context loop, so the hot loop carries no extra loads or selects.
    if NX > 0:  # noqa: SIM102 (constexpr test: the block code is not compiled for decode)
        if split == SPLITS - 1:
            for x0 in tl.static_range(0, NX, BLOCK_X):
                xi = x0 + tl.arange(0, BLOCK_X)
                x_ok = xi < NX
                x_off = b * s_xb + xi * s_xm + kvh * s_xh
                x_mask = x_ok[:, None] & d_ok[None, :]
                kx = tl.load(kx_ptr + x_off[:, None] + d[None, :], mask=x_mask, other=0.0)
                vx = tl.load(vx_ptr + x_off[:, None] + d[None, :], mask=x_mask, other=0.0)
                m_i, l_i, acc = _online_step(q, kx.to(q.dtype), vx.to(q.dtype), x_ok, m_i, l_i,
                                             acc, scale_log2, QUANT, DOT_PREC, UPCAST)

    o_off = b * s_ob + split * s_os + qi * s_om + qh * s_oh
    o_mask = row_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptr + o_off[:, None] + d[None, :], acc, mask=o_mask)
        ml_off = b * s_mb + split * s_ms + qi * s_mm + qh * s_mh
        tl.store(ml_ptr + ml_off, m_i if QUANT else m_i * scale_log2, mask=row_ok)  # in log2 units
        tl.store(ml_ptr + ml_off + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr, ml_ptr, o_ptr,
    s_pr, s_ps, s_mr, s_ms, s_or,
    D: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, S_PAD: tl.constexpr,
):
    """Merge the partial softmaxes of one (sequence, query, head) row."""
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, S_PAD)
    d = tl.arange(0, BLOCK_D)
    s_ok = sp < SPLITS
    m = tl.load(ml_ptr + r * s_mr + sp * s_ms, mask=s_ok, other=float("-inf"))
    ll = tl.load(ml_ptr + r * s_mr + sp * s_ms + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.where(s_ok & (m > float("-inf")), tl.exp2(m - m_max), 0.0)
    den = tl.sum(w * ll, 0)
    part = tl.load(
        part_ptr + r * s_pr + sp[:, None] * s_ps + d[None, :],
        mask=s_ok[:, None] & (d < D)[None, :], other=0.0,
    )
    out = tl.sum(w[:, None] * part, 0) / tl.where(den == 0.0, 1.0, den)
    tl.store(o_ptr + r * s_or + d, out.to(o_ptr.dtype.element_ty), mask=d < D)


# The most splits a sequence is cut into: only a grid of fewer than ~17 (sequence, KV head)
# pairs reaches it. 32: the fp32 verify of batch 1 (8 rows, 4 KV heads, 2K context) takes
# 7.8-8.6 us at 32 splits against 12.4 us at 16 on the H200 (bench/KERNEL_NOTES.md).
# PDFLOW_ATTN_MAX_SPLITS overrides it in every rank of a deployment, for A/B benches.
MAX_SPLITS = int(os.environ.get("PDFLOW_ATTN_MAX_SPLITS", "32"))


def default_splits(batch: int, h_kv: int, device: torch.device, max_context: int | None) -> int:
    """Enough programs to fill the GPU about twice, never splits shorter than 256 tokens."""
    splits = max(1, min(MAX_SPLITS, triton.cdiv(2 * sm_count(device, cpu=132), batch * h_kv)))
    if max_context is not None:
        splits = max(1, min(splits, triton.cdiv(max_context, 256)))
    return splits


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeTiles:
    """What a launch defaults to (``decode_tiles``)."""

    block_n: int
    num_warps: int
    num_stages: int
    v_pages: bool  # an fp8 V read a page at a time ([pages, D, page])


def decode_tiles(*, quant: bool, page: int, block_m: int, nx: int, itemsize: int, cuda: bool,
                 block_n: int | None = None, v_pages: bool = True, head_dim: int = 128) -> DecodeTiles:
    """The default tile, warps and stages of a launch (``block_n`` given: the rest for it).
    fp8: half the bytes per tile, so twice the tokens (1.3x on the H200). A 16-bit DSpark
    block (32 rows at K=8 x GQA 4): 128-token tiles halve the loop's softmax and rescale
    steps per byte, 1.36x the 64-token tile on the H200 (1.06-1.09x a decode step,
    bench/RESULTS.md); fp32 tiles of 128 would not fit 4 stages. A 16-bit cache at head
    dim 64: half the bytes per token, so twice the tokens, as fp8 (2K context: 0.91-0.93x
    a same-traffic copy at 64 tokens, 0.97-0.99x at 128, in CUDA graphs on the H200). Four warps and four stages
    were fastest on the H200 at B64 x 8 heads (bn64, one split); an fp8 decode reads K and V
    a page at a time, with two warps and two stages over pages shorter than the tile (page
    16: 1.02-1.07x four and four at 8K-32K tokens, bench/KERNEL_NOTES.md rows 47-48, 53), and
    three stages over one page a tile (page 128: 1.07-1.14x K per token at four warps and four
    stages, 0.91-0.94x a same-traffic copy in CUDA graphs on the H200, row 54). A 16-bit
    DSpark block at head dim 64: two warps, three stages (a warp then holds 16 of the 32 rows
    over the whole tile: 1.39-1.40x faster than four warps in CUDA graphs on the H200, row 51)."""
    if block_n is None:
        wide = quant or (itemsize <= 2 and (nx > 0 or head_dim <= 64))
        block_n = (128 if wide else 64) if block_m <= 64 else 32
    # False: V as one [tokens, D] tile and K per token (A/B); a decode at pages as long as
    # the tile reads them a page at a time too (one page a tile), the DSpark block pass not
    v_pages = v_pages and quant and (page < block_n or (page == block_n and nx == 0))
    narrow = v_pages and nx == 0
    small_block = nx > 0 and not quant and itemsize <= 2 and head_dim <= 64  # the d64 16-bit block pass
    stages = 2 if narrow and page < block_n else 3 if narrow or small_block else 4
    return DecodeTiles(block_n=block_n, num_warps=2 if narrow or small_block else 4,
                       num_stages=stages if cuda else 1, v_pages=v_pages)


def paged_attention(
    q, k_cache, v_cache, context_lens, block_tables, scale, k_extra=None, v_extra=None,
    *, k_scale=None, v_scale=None, num_splits=None, max_context=None, block_n=None,
    num_warps=None, num_stages=None, out=None, v_pages=True,
):
    """q [B, NQ, H_q, D] over each sequence's paged context plus optional extra tokens
    k/v_extra [B, NX, H_kv, D] (non-causal, every row sees every token) -> [B, NQ, H_q, D].
    ``num_splits`` cuts each sequence into that many chunks (default: fill the GPU);
    ``out`` may be a preallocated [B, NQ, H_q, D] (contiguous) for CUDA graphs.
    ``k_scale``/``v_scale``: an fp8 cache's scale caches ([..., page, 1] uint8); its V
    head pages stored transposed (kernels/reference.py), K and V read a page at a time when
    pages are no longer than the tile (``decode_tiles``; ``v_pages=False``: K per token and V
    as one [tokens, D] tile, for A/B)."""
    bsz, nq, h_q, d = q.shape
    _, ppb, h_kv, page, dc = k_cache.shape
    assert d == dc and h_q % h_kv == 0 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1 and q.stride(-1) == 1
    # a scale's offset is its token-head's element offset / D
    quant, k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale, context_lens)
    group = h_q // h_kv
    g_pad = triton.next_power_of_2(group)
    block_m = max(16, triton.next_power_of_2(nq * g_pad))
    block_d = max(16, triton.next_power_of_2(d))
    nx = 0 if k_extra is None else k_extra.shape[1]
    tiles = decode_tiles(quant=quant, page=page, block_m=block_m, nx=nx, itemsize=q.element_size(),
                         cuda=q.is_cuda, block_n=block_n, v_pages=v_pages, head_dim=d)
    block_n = tiles.block_n
    num_warps = tiles.num_warps if num_warps is None else num_warps
    num_stages = tiles.num_stages if num_stages is None else num_stages
    if num_splits is None:
        num_splits = default_splits(bsz, h_kv, q.device, max_context)
    if nx:
        assert k_extra.stride() == v_extra.stride() and k_extra.stride(-1) == 1
        x_strides = k_extra.stride()[:3]
    else:
        k_extra = v_extra = k_cache
        x_strides = (0, 0, 0)
    if out is None:
        out = torch.empty_like(q)
    if num_splits == 1:
        target, ml = out, out
        o_strides = (out.stride(0), 0, out.stride(1), out.stride(2))
        ml_strides = (0, 0, 0, 0)
    else:
        # Partials are [B, NQ, H_q, splits, D] (and m, l as [..., splits, 2]) so that the
        # merge pass reads one (b, q, h) row as a contiguous [splits, D] tile.
        target = torch.empty((bsz, nq, h_q, num_splits, d), device=q.device, dtype=torch.float32)
        ml = torch.empty((bsz, nq, h_q, num_splits, 2), device=q.device, dtype=torch.float32)
        t, m = target.stride(), ml.stride()
        o_strides = (t[0], t[3], t[1], t[2])
        ml_strides = (m[0], m[3], m[1], m[2])
    _paged_split_kernel[(bsz * h_kv, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, k_extra, v_extra, context_lens, block_tables,
        target, ml,
        scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2),
        *x_strides,
        *k_cache.stride()[:4],
        *(k_scale.stride()[:3] if quant else (0, 0, 0)),
        block_tables.stride(0),
        *o_strides,
        *ml_strides,
        H_KV=h_kv, NQ=nq, NX=nx, G=group, G_PAD=g_pad, D=d, BLOCK_D=block_d,
        PAGE=page, PPB=ppb, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_X=max(16, triton.next_power_of_2(max(nx, 1))), SPLITS=num_splits,
        DOT_PREC=dot_precision(q.dtype), UPCAST=interpreting(q),
        QUANT=quant, SW=min(page, block_n), F8_F16=quant and q.dtype == torch.bfloat16,
        V_PAGES=tiles.v_pages,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        assert out.is_contiguous()
        _merge_splits_kernel[(bsz * nq * h_q,)](
            target, ml, out,
            num_splits * d, d, num_splits * 2, 2, d,
            D=d, BLOCK_D=block_d, SPLITS=num_splits, S_PAD=triton.next_power_of_2(num_splits),
        )
    return out


def decode_attention(q, k_cache, v_cache, context_lens, block_tables, scale, k_scale=None,
                     v_scale=None, **tuning):
    """q [B, H_q, D]: one new token per sequence over its first ``context_lens[b]`` tokens."""
    if tuning.get("out") is not None:
        tuning["out"] = tuning["out"][:, None]
    return paged_attention(
        q[:, None], k_cache, v_cache, context_lens, block_tables, scale,
        k_scale=k_scale, v_scale=v_scale, **tuning
    )[:, 0]
