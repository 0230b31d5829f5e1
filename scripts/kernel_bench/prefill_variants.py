"""Experimental prefill variants for the bench sweep (not installed, not served).

The production kernels are pdflow.kernels' pointer kernel (prefill_attention.py) and
TMA kernel (prefill_tma.py). The variant kernel here keeps their tiling (rows = query
tokens x GQA group, heaviest causal tiles first, unmasked loop then diagonal loop),
reuses the TMA kernel's loads, row and store helpers, and exposes one switch per idea
so one GPU run can say which helps (measurements: bench/KERNEL_NOTES.md):

- ``kv="ptr" | "tma" | "tma2d"``: pointer loads, descriptor boxes of pages, or (page ==
  block only) descriptor boxes of rows of ``[num_blocks * H_kv * page, D]``.
- ``loop_stages``/``warp_specialize``: the unmasked K/V loop as ``tl.range`` with its own
  pipeline depth and (triton >= 3.4 API) warp specialisation.
- ``prescale``: Q is multiplied by ``scale * log2(e)`` once, so each S tile goes
  straight into exp2.
- ``persistent``: one program per SM walks the heavy-first tile list round robin.
- ``exp="bf16x2"``: p from the packed 16-bit MUFU ex2, two exps per instruction, already
  in the PV dot's dtype.
- ``split=2``: the ``BLOCK_M`` rows as two halves sharing every K/V tile (the TMA
  kernel's choice).

Every variant falls back to pointer loads where a descriptor cannot describe the tile.
"""

from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
from pdflow.kernels._common import (
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
from pdflow.kernels.prefill_tma import (
    PAGE_BOXES,
    ROW_BOXES,
    kv_descriptors,
    load_kv_tile,
    load_rows,
    store_rows,
    tma_kv_mode,
    tma_supported,
)

__all__ = ["prefill_attention_variant", "tma_supported", "variant_kv_mode", "ws_supported"]


def ws_supported() -> bool:
    return "warp_specialize" in inspect.signature(tl.range.__init__).parameters


@triton.jit
def _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
             H_KV: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_MODE: tl.constexpr):
    """K and V of tokens n0 .. n0 + BLOCK_N of one head (all valid blocks of the table)."""
    if KV_MODE == 0:
        pos = n0 + tl.arange(0, BLOCK_N)
        tok = page_offsets(bt_row, pos, pos < n0 + BLOCK_N, kvh, s_cb, s_cp, s_ch, s_ct, PAGE,
                           PPB)
        k = tl.load(k_src + tok[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
        v = tl.load(v_src + tok[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    else:
        k, v = load_kv_tile(k_src, v_src, bt_row, n0, kvh, H_KV, PAGE, PPB, BLOCK_N, BLOCK_D,
                            KV_MODE)
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
    """The TMA kernel's row half, with q prescaled when PRESCALE."""
    q, qpos, q_row, hh, io_mask = load_rows(q_ptr, q_start, q_len, base, mt, kvh, half, s_qt,
                                            s_qh, G, G_PAD, D, BLOCK_D, HM, TOK)
    if PRESCALE:
        q = (q.to(tl.float32) * scale_log2).to(q.dtype)
    return q, qpos, q_row, hh, io_mask


@triton.jit
def _tile(tile, q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr, scale_log2, n_bh, n_m,
          s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
          H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
          BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr,
          LOOP_STAGES: tl.constexpr, WS: tl.constexpr, PRESCALE: tl.constexpr,
          SPLIT: tl.constexpr, EXP: tl.constexpr, DOT_PREC: tl.constexpr,
          UPCAST: tl.constexpr):
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
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE)
            m0, l0, a0, m1, l1, a1 = _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2,
                                             cols >= 0, cols, qp0, qp1, False, SPLIT, PRESCALE,
                                             EXP, DOT_PREC, UPCAST)
    elif WS:
        for n0 in tl.range(0, full_end, BLOCK_N, num_stages=LOOP_STAGES, warp_specialize=True):
            k, v = _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE)
            m0, l0, a0, m1, l1, a1 = _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2,
                                             cols >= 0, cols, qp0, qp1, False, SPLIT, PRESCALE,
                                             EXP, DOT_PREC, UPCAST)
    else:
        for n0 in tl.range(0, full_end, BLOCK_N, num_stages=LOOP_STAGES):
            k, v = _load_kv(k_src, v_src, bt_row, n0, kvh, d, d_ok, s_cb, s_cp, s_ch, s_ct,
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE)
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
                            H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE)
        m0, l0, a0, m1, l1, a1 = _halves(q0, q1, k, v, m0, l0, a0, m1, l1, a1, scale_log2, ok,
                                         pos, qp0, qp1, True, SPLIT, PRESCALE, EXP, DOT_PREC,
                                         UPCAST)

    store_rows(o_ptr, a0, l0, r0, hh0, kvh, io0, s_ot, s_oh, G, BLOCK_D)
    if SPLIT == 2:
        store_rows(o_ptr, a1, l1, r1, hh1, kvh, io1, s_ot, s_oh, G, BLOCK_D)


@triton.jit
def _prefill_variant_kernel(
    q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr,
    scale_log2, n_bh, n_m, n_prog,
    s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr,
    LOOP_STAGES: tl.constexpr, WS: tl.constexpr, PERSISTENT: tl.constexpr,
    PRESCALE: tl.constexpr, SPLIT: tl.constexpr, EXP: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in range(pid, n_m * n_bh, n_prog):
            _tile(tile, q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr, scale_log2,
                  n_bh, n_m, s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
                  H_KV, G, G_PAD, D, BLOCK_D, PAGE, PPB, BLOCK_M, BLOCK_N, KV_MODE,
                  LOOP_STAGES, WS, PRESCALE, SPLIT, EXP, DOT_PREC, UPCAST)
    else:
        _tile(pid, q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr, scale_log2,
              n_bh, n_m, s_qt, s_qh, s_ot, s_oh, s_cb, s_cp, s_ch, s_ct, s_bt,
              H_KV, G, G_PAD, D, BLOCK_D, PAGE, PPB, BLOCK_M, BLOCK_N, KV_MODE,
              LOOP_STAGES, WS, PRESCALE, SPLIT, EXP, DOT_PREC, UPCAST)


def _kv_mode(k_cache, v_cache, kv: str, block_n: int) -> int:
    """0 pointer loads, PAGE_BOXES for ``tma``, ROW_BOXES for ``tma2d`` where the TMA
    kernel would use row boxes (one page per block)."""
    if kv == "ptr":
        return 0
    mode = tma_kv_mode(k_cache, v_cache, block_n)
    return PAGE_BOXES if mode == ROW_BOXES and kv == "tma" else mode


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
    mode = _kv_mode(k_cache, v_cache, kv, block_n)
    k_src, v_src = kv_descriptors(k_cache, v_cache, block_n, mode) if mode else (k_cache, v_cache)
    n_m = triton.cdiv(max_seqlen_q, block_m // g_pad)
    tiles = n_m * bsz * h_kv
    n_prog = min(tiles, sm_count(q.device, cpu=4)) if persistent else tiles
    _prefill_variant_kernel[(n_prog,)](
        q, k_src, v_src, cu_seqlens_q, context_lens, block_tables, out,
        scale * LOG2E, bsz * h_kv, n_m, n_prog,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:4], block_tables.stride(0),
        H_KV=h_kv, G=group, G_PAD=g_pad, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PAGE=page, PPB=ppb, BLOCK_M=block_m, BLOCK_N=block_n, KV_MODE=mode,
        LOOP_STAGES=loop_stages, WS=bool(warp_specialize), PERSISTENT=bool(persistent),
        PRESCALE=bool(prescale), SPLIT=split, EXP=exp_mode(exp, q.dtype),
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def variant_kv_mode(k_cache, kv: str, block_n: int) -> str:
    """Which K/V path a call would take ("ptr", "tma", "tma2d"): the bench labels rows."""
    return ("ptr", "tma", "tma2d")[_kv_mode(k_cache, k_cache, kv, block_n)]
