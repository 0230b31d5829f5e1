"""Round-3 prefill variants (issue 6): the loop written the way the fastest Triton
attention kernels on Hopper write it, plus three attempts at the softmax bottleneck.

Same contract and tiling as ``prefill_variants`` (rows = query tokens x GQA group,
heaviest causal tiles first, off-diagonal loop without masks then the diagonal loop),
K/V always through TMA boxes. What differs, each behind a switch so one GPU run can
rank them:

- the inner step is the tutorial's: row max taken before scaling, ``s * scale - m`` as
  one FMA, ``acc *= alpha`` then ``tl.dot(p, v, acc)`` (accumulate in the wgmma), a
  finite mask fill (no -inf arithmetic, no m_safe select);
- ``exp="bf16x2"``: p = ex2.approx.ftz.bf16x2 on packed pairs: half the MUFU
  instructions, and p comes out in the dot's dtype (H100: exp throughput is ~1/2 of
  the matmul time at d128, FA3 paper);
- ``dev_desc``: descriptors built in the kernel (``tl.make_tensor_descriptor``, needs
  ``triton.set_allocator``), as the tutorial does for Hopper + warp specialisation;
- ``warp_specialize``: both loops as ``tl.range(..., warp_specialize=True)``;
- ``split=2``: the 128-row tile as two 64-row halves sharing each K/V tile, so the
  compiler may overlap one half's softmax with the other's wgmma.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, dot_precision, exp2_as, exp_mode, interpreting
from .prefill_variants import TensorDescriptor, _kv_sources, ws_supported

__all__ = ["prefill_attention_ws", "ws_kv_mode"]

NEG = tl.constexpr(-1.0e30)  # finite mask fill: exp2(NEG - m) == 0 without inf - inf


def _has_device_desc() -> bool:
    return hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")


@triton.jit
def _dot_acc(a, b, acc, PREC: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b inside the dot (wgmma accumulates in place); fp32 operands on CPU."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _step(q, k, v, m_i, l_i, acc, qk_scale, qpos, pos, ok, MASKED: tl.constexpr,
          EXP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        s = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    if MASKED:
        keep = (pos[None, :] <= qpos[:, None]) & ok[None, :]
        s = tl.where(keep, s * qk_scale, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        x = s - m_new[:, None]
        v = tl.where(ok[:, None], v, 0.0)  # descriptor loads past the context: maybe NaN
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        x = s * qk_scale - m_new[:, None]
    p = exp2_as(x, v.dtype, EXP, UPCAST)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
    acc = _dot_acc(p, v, acc * alpha[:, None], DOT_PREC, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _load_kv(k_d, v_d, bt_row, n0, kvh, H_KV: tl.constexpr, PAGE: tl.constexpr,
             PPB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             KV_MODE: tl.constexpr):
    blk = tl.load(bt_row + n0 // (PAGE * PPB))
    off = n0 % (PAGE * PPB)
    if KV_MODE == 1:
        page = blk * PPB + off // PAGE
        k = k_d.load([page, kvh, off % PAGE, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_d.load([page, kvh, off % PAGE, 0]).reshape(BLOCK_N, BLOCK_D)
    else:
        row = (blk * H_KV + kvh) * PAGE + off
        k = k_d.load([row, 0])
        v = v_d.load([row, 0])
    return k, v


@triton.jit
def _loop(q0, q1, m0, l0, a0, m1, l1, a1, qp0, qp1, lo, hi, k_d, v_d, bt_row, kvh,
          qk_scale, H_KV: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KV_MODE: tl.constexpr,
          MASKED: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
          EXP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    for n0 in tl.range(lo, hi, BLOCK_N, num_stages=STAGES, warp_specialize=WS):
        k, v = _load_kv(k_d, v_d, bt_row, n0, kvh, H_KV, PAGE, PPB, BLOCK_N, BLOCK_D, KV_MODE)
        pos = n0 + cols
        ok = pos < hi
        m0, l0, a0 = _step(q0, k, v, m0, l0, a0, qk_scale, qp0, pos, ok, MASKED, EXP,
                           DOT_PREC, UPCAST)
        if SPLIT == 2:
            m1, l1, a1 = _step(q1, k, v, m1, l1, a1, qk_scale, qp1, pos, ok, MASKED, EXP,
                               DOT_PREC, UPCAST)
    return m0, l0, a0, m1, l1, a1


@triton.jit
def _half_rows(q_ptr, cu_ptr, lens_ptr, b, kvh, mt, half, s_qt, s_qh,
               G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               HM: tl.constexpr, TOK: tl.constexpr):
    """Rows ``half * HM ..`` of query tile ``mt``: q, query positions, token, head, mask."""
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    base = tl.load(lens_ptr + b) - q_len
    rows = half * HM + tl.arange(0, HM)
    ti = mt * TOK + rows // G_PAD
    hh = rows % G_PAD
    d = tl.arange(0, BLOCK_D)
    io_mask = ((ti < q_len) & (hh < G))[:, None] & (d < D)[None, :]
    tok = (q_start + ti).to(tl.int64)
    head = kvh * G + hh
    q = tl.load(q_ptr + (tok * s_qt + head * s_qh)[:, None] + d[None, :], mask=io_mask,
                other=0.0)
    return q, base + ti, tok, head, io_mask


@triton.jit
def _make_desc(src, kv_rows, s_cp, s_ch, s_ct, H_KV: tl.constexpr, PAGE: tl.constexpr,
               D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               KV_MODE: tl.constexpr, NP: tl.constexpr, PG: tl.constexpr):
    """The host descriptor's view, built in the kernel (global scratch from the allocator)."""
    if KV_MODE == 1:
        return tl.make_tensor_descriptor(src, [kv_rows, H_KV, PAGE, D], [s_cp, s_ch, s_ct, 1],
                                         [NP, 1, PG, BLOCK_D])
    else:
        return tl.make_tensor_descriptor(src, [kv_rows, D], [s_ct, 1], [BLOCK_N, BLOCK_D])


# The bench checks on a 4-sequence case, then times one 8K prompt: keep one compile.
@triton.jit(do_not_specialize=["n_bh", "n_m", "kv_rows", "s_bt"])
def _prefill_ws_kernel(
    q_ptr, k_src, v_src, cu_ptr, lens_ptr, bt_ptr, o_ptr, qk_scale, n_bh, n_m, kv_rows,
    s_qt, s_qh, s_ot, s_oh, s_cp, s_ch, s_ct, s_bt,
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr, NP: tl.constexpr, PG: tl.constexpr,
    DEV_DESC: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr, WS: tl.constexpr,
    EXP: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M // G_PAD
    HM: tl.constexpr = BLOCK_M // SPLIT
    pid = tl.program_id(0)
    mt = n_m - 1 - pid // n_bh
    bh = pid % n_bh
    b = bh // H_KV
    kvh = bh % H_KV
    if DEV_DESC:
        k_d = _make_desc(k_src, kv_rows, s_cp, s_ch, s_ct, H_KV, PAGE, D, BLOCK_N, BLOCK_D,
                         KV_MODE, NP, PG)
        v_d = _make_desc(v_src, kv_rows, s_cp, s_ch, s_ct, H_KV, PAGE, D, BLOCK_N, BLOCK_D,
                         KV_MODE, NP, PG)
    else:
        k_d = k_src
        v_d = v_src

    q0, qp0, t0, h0, io0 = _half_rows(q_ptr, cu_ptr, lens_ptr, b, kvh, mt, 0, s_qt, s_qh,
                                      G, G_PAD, D, BLOCK_D, HM, TOK)
    if SPLIT == 2:
        q1, qp1, t1, h1, io1 = _half_rows(q_ptr, cu_ptr, lens_ptr, b, kvh, mt, 1, s_qt, s_qh,
                                          G, G_PAD, D, BLOCK_D, HM, TOK)
    else:
        q1, qp1, t1, h1, io1 = q0, qp0, t0, h0, io0
    q_len = tl.load(cu_ptr + b + 1) - tl.load(cu_ptr + b)
    ctx = tl.load(lens_ptr + b)
    first = ctx - q_len + mt * TOK  # the tile's first query position
    live = mt * TOK < q_len
    full_end = tl.where(live, ((first + 1) // BLOCK_N) * BLOCK_N, 0)
    diag_end = tl.where(live, tl.minimum(first + TOK, ctx), 0)
    bt_row = bt_ptr + b.to(tl.int64) * s_bt

    m0 = tl.full([HM], float("-inf"), tl.float32)
    l0 = tl.zeros([HM], tl.float32)
    a0 = tl.zeros([HM, BLOCK_D], tl.float32)
    m1, l1, a1 = m0, l0, a0
    m0, l0, a0, m1, l1, a1 = _loop(q0, q1, m0, l0, a0, m1, l1, a1, qp0, qp1, 0, full_end,
                                   k_d, v_d, bt_row, kvh, qk_scale, H_KV, PAGE, PPB, BLOCK_N,
                                   BLOCK_D, KV_MODE, False, SPLIT, STAGES, WS, EXP, DOT_PREC,
                                   UPCAST)
    m0, l0, a0, m1, l1, a1 = _loop(q0, q1, m0, l0, a0, m1, l1, a1, qp0, qp1, full_end,
                                   diag_end, k_d, v_d, bt_row, kvh, qk_scale, H_KV, PAGE, PPB,
                                   BLOCK_N, BLOCK_D, KV_MODE, True, SPLIT, STAGES, WS, EXP,
                                   DOT_PREC, UPCAST)
    d = tl.arange(0, BLOCK_D)
    out_ty = o_ptr.dtype.element_ty
    o_off = t0 * s_ot + h0 * s_oh
    out = a0 / tl.where(l0 == 0.0, 1.0, l0)[:, None]
    tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(out_ty), mask=io0)
    if SPLIT == 2:
        o_off = t1 * s_ot + h1 * s_oh
        out = a1 / tl.where(l1 == 0.0, 1.0, l1)[:, None]
        tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(out_ty), mask=io1)


def _scratch(size: int, align: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ws_kv_mode(k_cache, block_n: int) -> str:
    """"tma2d" at page == block, "tma" for page boxes, "ptr" where no box fits (then
    ``prefill_attention_ws`` refuses: every variant here needs TMA)."""
    return ("ptr", "tma", "tma2d")[_kv_sources(k_cache, k_cache, "tma2d", block_n)[0]]


def prefill_attention_ws(
    q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, *,
    max_seqlen_q=None, exp="exp2", dev_desc=False, warp_specialize=False, split=1,
    loop_stages=3, block_m=128, block_n=128, num_warps=8, num_stages=2, out=None,
):
    """Same contract as ``prefill_attention``; keywords pick the variant (module doc).
    Raises where this triton lacks an API the variant needs (the bench records it)."""
    t, h_q, d = q.shape
    nb, ppb, h_kv, page, dc = k_cache.shape
    assert d == dc and h_q % h_kv == 0 and k_cache.stride() == v_cache.stride()
    assert q.stride(-1) == 1 and split in (1, 2)
    if TensorDescriptor is None or (dev_desc and not _has_device_desc()):
        raise RuntimeError(f"tensor descriptors unavailable in triton {triton.__version__}")
    if warp_specialize and not ws_supported():
        raise RuntimeError(f"tl.range(warp_specialize=) needs a newer triton than {triton.__version__}")
    bsz = context_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or bsz == 0:
        return out
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = h_q // h_kv
    g_pad = triton.next_power_of_2(group)
    upcast = interpreting(q)
    block_m = max(block_m, g_pad * split, 16 * split)
    mode, k_src, v_src, np_, pg = _kv_sources(k_cache, v_cache, "tma2d", block_n)
    if mode == 0:
        raise ValueError(f"no TMA box for page {page} x {ppb} with block_n {block_n}")
    kv_rows = nb * ppb if mode == 1 else nb * h_kv * page
    if dev_desc:
        k_src, v_src = k_cache, v_cache
        if q.is_cuda:
            triton.set_allocator(_scratch)
    n_m = triton.cdiv(max_seqlen_q, block_m // g_pad)
    s = k_cache.stride()
    _prefill_ws_kernel[(n_m * bsz * h_kv,)](
        q, k_src, v_src, cu_seqlens_q, context_lens, block_tables, out,
        scale * LOG2E, bsz * h_kv, n_m, kv_rows,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), s[1], s[2], s[3],
        block_tables.stride(0),
        H_KV=h_kv, G=group, G_PAD=g_pad, D=d, BLOCK_D=d, PAGE=page, PPB=ppb,
        BLOCK_M=block_m, BLOCK_N=block_n, KV_MODE=mode, NP=np_, PG=pg,
        DEV_DESC=bool(dev_desc), SPLIT=split, STAGES=loop_stages,
        WS=bool(warp_specialize), EXP=exp_mode(exp, q.dtype), DOT_PREC=dot_precision(q.dtype),
        UPCAST=upcast, num_warps=num_warps, num_stages=num_stages,
    )
    return out
