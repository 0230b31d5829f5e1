"""Prefill attention variants aimed at SDPA parity on Hopper, selectable by the bench sweep.

The default prefill kernel (prefill_attention.py) gathers K/V rows through pointers
(cp.async) and reached 0.68x SDPA on the H200. The variants here keep its tiling (rows =
query tokens x GQA group, heaviest causal tiles first, unmasked loop then diagonal loop)
and change one thing each, so one GPU run can say which helps:

- ``kv="tma"``: K/V tiles come through host tensor descriptors (TMA) over the cache
  viewed as ``[num_blocks * pages_per_block, H_kv, page, D]``; a tile is one box of
  ``BLOCK_N // page`` pages of one head (needs ``block_size % BLOCK_N == 0``).
  ``kv="tma2d"`` (page == block only): rows of ``[num_blocks * H_kv * page, D]``, a
  plain 2D box, so no reshape sits between the copy and the dot.
- ``loop_stages``/``warp_specialize``: the K/V loops as ``tl.range`` with their own
  pipeline depth and (triton >= 3.4 API) warp specialisation.
- ``prescale``: Q is multiplied by ``scale * log2(e)`` once, so each S tile goes
  straight into exp2 (normalisation is deferred to the end in every variant).
- ``persistent``: one program per SM walks the heavy-first tile list round robin.
- ``exp="bf16x2"`` (round 4; +21% on round 3's experimental kernel, since removed): p from the packed
  16-bit MUFU ex2, two exps per instruction, already in the PV dot's dtype.
- ``split=2`` (round 4, from round 3's +16%): the ``BLOCK_M`` rows as two halves that
  share every K/V tile, each with its own softmax state, so one half's softmax has
  the other's wgmma to hide behind.

Every variant falls back to pointer loads where a descriptor cannot describe the tile.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    dot_precision,
    exp2_as,
    exp_mode,
    interpreting,
    mma,
    page_offsets,
    prefill_shapes,
    prefill_tile,
    sm_count,
)

__all__ = ["prefill_attention_variant", "tma_supported", "variant_kv_mode", "ws_supported"]

try:  # host-side descriptors: triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older triton
    TensorDescriptor = None


def tma_supported() -> bool:
    return TensorDescriptor is not None


def ws_supported() -> bool:
    return "warp_specialize" in inspect.signature(tl.range.__init__).parameters


@triton.jit
def _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
             H_KV: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_MODE: tl.constexpr,
             NP: tl.constexpr, PG: tl.constexpr):
    """K and V of tokens n0 .. n0 + BLOCK_N of one head (all valid blocks of the table)."""
    if KV_MODE == 0:
        pos = n0 + tl.arange(0, BLOCK_N)
        tok = page_offsets(bt_row, pos, pos < n0 + BLOCK_N, kvh, s_cb, s_cp, s_ch, s_ct, PAGE,
                           PPB)
        k = tl.load(k_src + tok[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(v_src + tok[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    else:
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
def _attend(q, k, v, m_i, l_i, acc, scale_log2, ok, pos, qpos, MASKED: tl.constexpr,
            PRESCALE: tl.constexpr, EXP: tl.constexpr, DOT_PREC: tl.constexpr,
            UPCAST: tl.constexpr):
    s = mma(q, tl.trans(k), DOT_PREC, UPCAST)
    if not PRESCALE:
        s = s * scale_log2
    if MASKED:
        s = tl.where((pos[None, :] <= qpos[:, None]) & ok[None, :], s, float("-inf"))
        # Descriptor loads are not masked: drop V rows past the context (NaN-safe).
        v = tl.where(ok[:, None], v, 0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    alpha = tl.exp2(m_i - m_safe)
    if EXP == 0:
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(v.dtype)
    else:  # ex2 of -inf is +0 in the packed form too
        p = exp2_as(s - m_safe[:, None], v.dtype, EXP, UPCAST)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    acc = acc * alpha[:, None] + mma(p, v, DOT_PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2, ok, pos, qp0, qp1,
            MASKED: tl.constexpr, SPLIT: tl.constexpr, PRESCALE: tl.constexpr,
            EXP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One K/V tile for each row half (SPLIT 1: the second state passes through)."""
    m0, l0, a0 = _attend(q0, k, v, m0, l0, a0, scale_log2, ok, pos, qp0, MASKED, PRESCALE,
                         EXP, DOT_PREC, UPCAST)
    if SPLIT == 2:
        m1, l1, a1 = _attend(q1, k, v, m1, l1, a1, scale_log2, ok, pos, qp1, MASKED,
                             PRESCALE, EXP, DOT_PREC, UPCAST)
    return m0, l0, a0, m1, l1, a1


@triton.jit
def _rows(q_ptr, q_start, q_len, base, mt, kvh, half, scale_log2, s_qt, s_qh,
          G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
          HM: tl.constexpr, TOK: tl.constexpr, PRESCALE: tl.constexpr):
    """Rows ``half * HM ..`` of query tile ``mt``: q, query positions, token row, head
    in the group, store mask."""
    rows = half * HM + tl.arange(0, HM)
    ti = mt * TOK + rows // G_PAD
    hh = rows % G_PAD
    d = tl.arange(0, BLOCK_D)
    io_mask = ((ti < q_len) & (hh < G))[:, None] & (d < D)[None, :]
    q_row = (q_start + ti).to(tl.int64)
    q = tl.load(q_ptr + (q_row * s_qt + (kvh * G + hh) * s_qh)[:, None] + d[None, :],
                mask=io_mask, other=0.0)
    if PRESCALE:
        q = (q.to(tl.float32) * scale_log2).to(q.dtype)
    return q, base + ti, q_row, hh, io_mask


@triton.jit
def _store(o_ptr, acc, l_i, q_row, hh, kvh, io_mask, s_ot, s_oh, G: tl.constexpr,
           BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = q_row * s_ot + (kvh * G + hh) * s_oh
    tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _tile(tile, q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr, scale_log2, n_bh, n_m,
          s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
          H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
          BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr,
          NP: tl.constexpr, PG: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr,
          PRESCALE: tl.constexpr, SPLIT: tl.constexpr, EXP: tl.constexpr,
          DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    TOK: tl.constexpr = BLOCK_M // G_PAD
    HM: tl.constexpr = BLOCK_M // SPLIT
    mt, b, kvh, q_start, q_len, base, full_end, diag_end = prefill_tile(
        tile, n_bh, n_m, cu_ptr, lens_ptr, H_KV, TOK, BLOCK_N
    )

    q0, qp0, r0, hh0, io0 = _rows(q_ptr, q_start, q_len, base, mt, kvh, 0, scale_log2, s_qt,
                                  s_qh, G, G_PAD, D, BLOCK_D, HM, TOK, PRESCALE)
    if SPLIT == 2:
        q1, qp1, r1, hh1, io1 = _rows(q_ptr, q_start, q_len, base, mt, kvh, 1, scale_log2,
                                      s_qt, s_qh, G, G_PAD, D, BLOCK_D, HM, TOK, PRESCALE)
    else:
        q1, qp1, r1, hh1, io1 = q0, qp0, r0, hh0, io0
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D

    bt_row = bt_ptr + b.to(tl.int64) * s_bt
    m0 = tl.full([HM], float("-inf"), tl.float32)
    l0 = tl.zeros([HM], tl.float32)
    a0 = tl.zeros([HM, BLOCK_D], tl.float32)
    m1, l1, a1 = m0, l0, a0
    cols = tl.arange(0, BLOCK_N)
    if LOOP_STAGES == 0:
        for n0 in range(0, full_end, BLOCK_N):
            k, v = _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE, NP, PG)
            m0, l0, a0, m1, l1, a1 = _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2,
                                             cols >= 0, cols, qp0, qp1, False, SPLIT, PRESCALE,
                                             EXP, DOT_PREC, UPCAST)
    elif WS:
        for n0 in tl.range(0, full_end, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=True):
            k, v = _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE, NP, PG)
            m0, l0, a0, m1, l1, a1 = _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2,
                                             cols >= 0, cols, qp0, qp1, False, SPLIT, PRESCALE,
                                             EXP, DOT_PREC, UPCAST)
    else:
        for n0 in tl.range(0, full_end, BLOCK_N, num_stages=LOOP_STAGES):
            k, v = _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE, NP, PG)
            m0, l0, a0, m1, l1, a1 = _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2,
                                             cols >= 0, cols, qp0, qp1, False, SPLIT, PRESCALE,
                                             EXP, DOT_PREC, UPCAST)
    for n0 in range(full_end, diag_end, BLOCK_N):
        pos = n0 + cols
        ok = pos < diag_end
        if KV_MODE == 0:  # pointer loads are masked (and never leave the table)
            tok = page_offsets(bt_row, pos, ok, kvh, s_cb, s_cp, s_ch, s_ct, PAGE, PPB)
            kv_mask = ok[:, None] & d_ok[None, :]
            k = tl.load(k_src + tok[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_src + tok[:, None] + d[None, :], mask=kv_mask, other=0.0)
        else:
            k, v = _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE, NP, PG)
        m0, l0, a0, m1, l1, a1 = _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2, ok,
                                         pos, qp0, qp1, True, SPLIT, PRESCALE, EXP, DOT_PREC,
                                         UPCAST)

    _store(o_ptr, a0, l0, r0, hh0, kvh, io0, s_ot, s_oh, G, BLOCK_D)
    if SPLIT == 2:
        _store(o_ptr, a1, l1, r1, hh1, kvh, io1, s_ot, s_oh, G, BLOCK_D)


@triton.jit
def _prefill_variant_kernel(
    q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr,
    scale_log2, n_bh, n_m, n_prog,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr,
    NP: tl.constexpr, PG: tl.constexpr, LOOP_STAGES: tl.constexpr, WS: tl.constexpr,
    PERSISTENT: tl.constexpr, PRESCALE: tl.constexpr, SPLIT: tl.constexpr, EXP: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in range(pid, n_m * n_bh, n_prog):
            _tile(tile, q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr, scale_log2,
                  n_bh, n_m, s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
                  H_KV, G, G_PAD, D, BLOCK_D, PAGE, PPB, BLOCK_M, BLOCK_N, KV_MODE, NP, PG,
                  LOOP_STAGES, WS, PRESCALE, SPLIT, EXP, DOT_PREC, UPCAST)
    else:
        _tile(pid, q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr, scale_log2,
              n_bh, n_m, s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
              H_KV, G, G_PAD, D, BLOCK_D, PAGE, PPB, BLOCK_M, BLOCK_N, KV_MODE, NP, PG,
              LOOP_STAGES, WS, PRESCALE, SPLIT, EXP, DOT_PREC, UPCAST)


def _kv_mode(k_cache, v_cache, kv: str, block_n: int) -> int:
    """0 pointer loads, 1 ``tma`` page boxes, 2 ``tma2d`` row boxes: descriptors only
    where one box is one K/V tile of contiguous caches."""
    nb, ppb, h_kv, page, d = k_cache.shape
    fits = (kv != "ptr" and TensorDescriptor is not None and (page * ppb) % block_n == 0
            and d == triton.next_power_of_2(d) and k_cache.is_contiguous()
            and v_cache.is_contiguous())
    if not fits:
        return 0
    return 2 if kv == "tma2d" and ppb == 1 else 1


def _kv_sources(k_cache, v_cache, kv: str, block_n: int):
    """(mode, k source, v source, NP, PG): descriptors when the tile is one box."""
    nb, ppb, h_kv, page, d = k_cache.shape
    np_, pg = max(1, block_n // page), min(page, block_n)
    mode = _kv_mode(k_cache, v_cache, kv, block_n)
    if mode == 2:
        shape = [nb * h_kv * page, d]
        mk = lambda c: TensorDescriptor(c, shape, [d, 1], [block_n, d])  # noqa: E731
    elif mode == 1:
        shape = [nb * ppb, h_kv, page, d]
        strides = [h_kv * page * d, page * d, d, 1]
        mk = lambda c: TensorDescriptor(c, shape, strides, [np_, 1, pg, d])  # noqa: E731
    else:
        return 0, k_cache, v_cache, np_, pg
    return mode, mk(k_cache), mk(v_cache), np_, pg


def prefill_attention_variant(
    q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, *,
    max_seqlen_q=None, kv="ptr", loop_stages=0, warp_specialize=False, persistent=False,
    prescale=False, exp="exp2", split=1, block_m=128, block_n=128, num_warps=8, num_stages=2,
    out=None,
):
    """Same contract as ``prefill_attention``; the keywords pick the variant (module doc);
    ``variant_kv_mode`` says which K/V path a call takes."""
    assert split in (1, 2)
    if warp_specialize and not ws_supported():
        raise RuntimeError(f"tl.range(warp_specialize=) needs a newer triton than {triton.__version__}")
    t, _, d, ppb, h_kv, page, bsz, max_seqlen_q, group, g_pad = prefill_shapes(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, max_seqlen_q
    )
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or bsz == 0:
        return out
    upcast = interpreting(q)
    block_m = max(block_m, g_pad * split, 16 * split)
    mode, k_src, v_src, np_, pg = _kv_sources(k_cache, v_cache, kv, block_n)
    n_m = triton.cdiv(max_seqlen_q, block_m // g_pad)
    tiles = n_m * bsz * h_kv
    n_prog = min(tiles, sm_count(q.device, cpu=4)) if persistent else tiles
    _prefill_variant_kernel[(n_prog,)](
        q, k_src, v_src, cu_seqlens_q, context_lens, block_tables, out,
        scale * LOG2E, bsz * h_kv, n_m, n_prog,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:4], block_tables.stride(0),
        H_KV=h_kv, G=group, G_PAD=g_pad, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PAGE=page, PPB=ppb, BLOCK_M=block_m, BLOCK_N=block_n, KV_MODE=mode, NP=np_, PG=pg,
        LOOP_STAGES=loop_stages, WS=bool(warp_specialize), PERSISTENT=bool(persistent),
        PRESCALE=bool(prescale), SPLIT=split, EXP=exp_mode(exp, q.dtype),
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def variant_kv_mode(k_cache, kv: str, block_n: int) -> str:
    """Which K/V path a call would take ("ptr", "tma", "tma2d"): the bench labels rows."""
    return ("ptr", "tma", "tma2d")[_kv_mode(k_cache, k_cache, kv, block_n)]
