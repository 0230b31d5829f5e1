"""Causal prefill attention over the paged cache (prefix hits, chunked prefill, verify).

Flash-attention style: one program per (query tile, sequence, KV head), all on grid
axis 0 (no 65535 cap however many tokens are batched), heaviest (last) query tiles
launched first so the causal tail finishes together. A tile's rows are
``BLOCK_M // G_PAD`` query tokens times the GQA group, so every K/V tile loaded from
the pages feeds all query heads that share it. KV tiles wholly below the tile's first
query position run without masks; only the diagonal tiles mask. The chunk's own K/V
must already be in the cache (store_kv first), as in the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    LOG2E,
    dot_precision,
    interpreting,
    kv_scales,
    load_kv,
    mma,
    page_offsets,
    prefill_shapes,
    prefill_tile,
    shared_memory_limit,
)
from .reference import prefill_attention as prefill_attention_reference

__all__ = ["PrefillTiles", "prefill_attention", "prefill_attention_reference", "prefill_tiles",
           "tile_shared_memory"]


@dataclass(frozen=True, slots=True)
class PrefillTiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Under the interpreter: small tiles keep CPU tests fast (warps and stages do nothing).
INTERPRETER_TILES = PrefillTiles(block_m=32, block_n=16, num_warps=4, num_stages=1)


def tile_shared_memory(block_m: int, block_n: int, head_dim: int, num_stages: int,
                       itemsize: int) -> int:
    """An upper bound of the kernel's shared memory: the Q tile plus ``num_stages``
    buffered K and V tiles (bf16 d128 bm128 bn128 st2 compiles to exactly this)."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return (block_m + 2 * num_stages * block_n) * block_d * itemsize


def prefill_tiles(itemsize: int, head_dim: int, group_pad: int, smem_limit: int) -> PrefillTiles:
    """The largest tiles whose shared memory fits ``smem_limit``, starting from the H200's
    fastest for 16-bit d128 (bm128 bn128 w8 st2): halve BLOCK_N to 32, then drop to one
    stage, then BLOCK_N to 16, then halve BLOCK_M (never below the padded GQA group)."""
    block_m, block_n, stages = max(128, group_pad), 128, 2
    while tile_shared_memory(block_m, block_n, head_dim, stages, itemsize) > smem_limit:
        if block_n > 32:
            block_n //= 2
        elif stages > 1:
            stages = 1
        elif block_n > 16:
            block_n //= 2
        elif block_m > max(group_pad, 16):
            block_m //= 2
        else:  # nothing smaller exists: the compiler will say what it needs
            break
    return PrefillTiles(block_m=block_m, block_n=block_n,
                        num_warps=8 if block_m >= 128 else 4, num_stages=stages)


# Per-step integers (tiles, batch x heads, the block table's row stride) are not
# specialized: each class of them (1, a multiple of 16, other) would compile anew inside
# requests, and they only index tiles and scalar loads.
@triton.jit(do_not_specialize=["n_bh", "n_m", "s_bt"])
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cu_ptr, lens_ptr, bt_ptr, o_ptr,
    scale_log2, n_bh, n_m,
    s_qt, s_qh, s_ot, s_oh,
    s_cb, s_cp, s_ch, s_ct, s_bt,
    H_KV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, QUANT: tl.constexpr,
):
    TOK: tl.constexpr = BLOCK_M // G_PAD
    mt, b, kvh, q_start, q_len, base, full_end, diag_end = prefill_tile(
        tl.program_id(0), n_bh, n_m, cu_ptr, lens_ptr, H_KV, TOK, BLOCK_N
    )

    rows = tl.arange(0, BLOCK_M)
    ti = mt * TOK + rows // G_PAD
    hh = rows % G_PAD
    row_ok = (ti < q_len) & (hh < G)
    qpos = base + ti
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    io_mask = row_ok[:, None] & d_ok[None, :]
    q_row = (q_start + ti).to(tl.int64)
    q = tl.load(
        q_ptr + (q_row * s_qt + (kvh * G + hh) * s_qh)[:, None] + d[None, :],
        mask=io_mask, other=0.0,
    )

    bt_row = bt_ptr + b.to(tl.int64) * s_bt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < full_end
        tok = page_offsets(bt_row, pos, ok, kvh, s_cb, s_cp, s_ch, s_ct, PAGE, PPB)
        k = load_kv(kc_ptr, ks_ptr, tok, d, d_ok[None, :], ok, D, QUANT, q.dtype)
        v = load_kv(vc_ptr, vs_ptr, tok, d, d_ok[None, :], ok, D, QUANT, q.dtype, PAGE, QUANT)
        s = mma(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
        m_i = m_new
    for n0 in range(full_end, diag_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < diag_end
        tok = page_offsets(bt_row, pos, ok, kvh, s_cb, s_cp, s_ch, s_ct, PAGE, PPB)
        kv_mask = ok[:, None] & d_ok[None, :]
        k = load_kv(kc_ptr, ks_ptr, tok, d, kv_mask, ok, D, QUANT, q.dtype)
        v = load_kv(vc_ptr, vs_ptr, tok, d, kv_mask, ok, D, QUANT, q.dtype, PAGE, QUANT)
        s = mma(q, tl.trans(k), DOT_PREC, UPCAST) * scale_log2
        s = tl.where((pos[None, :] <= qpos[:, None]) & ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A padding row can see nothing in a diagonal tile: keep exp2 away from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, DOT_PREC, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = q_row * s_ot + (kvh * G + hh) * s_oh
    tl.store(o_ptr + o_off[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty), mask=io_mask)


def prefill_attention(
    q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
    *, max_seqlen_q=None, block_m=None, block_n=None, num_warps=None, num_stages=None,
    out=None, k_scale=None, v_scale=None,
):
    """q [T, H_q, D] (sequences packed by cu_seqlens_q) -> [T, H_q, D], causal over the
    paged context; pass ``max_seqlen_q`` to skip a device->host read of the lengths.
    Tile keywords left None come from ``prefill_tiles`` (fits the device's shared memory
    for any dtype and head_dim)."""
    t, _, d, ppb, h_kv, page, bsz, max_seqlen_q, group, g_pad = prefill_shapes(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, max_seqlen_q
    )
    if out is None:
        out = torch.empty_like(q)
    if t == 0 or bsz == 0:
        return out
    # fp8: dequantized as loaded (_common.load_kv), V from its transposed head pages
    quant, k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale, context_lens)
    upcast = interpreting(q)
    tiles = INTERPRETER_TILES if upcast else prefill_tiles(
        q.element_size(), d, g_pad, shared_memory_limit(q.device))
    block_m = max(block_m or tiles.block_m, g_pad, 16)
    block_n = block_n or tiles.block_n
    n_m = triton.cdiv(max_seqlen_q, block_m // g_pad)
    _prefill_kernel[(n_m * bsz * h_kv,)](
        q, k_cache, v_cache, k_scale, v_scale, cu_seqlens_q, context_lens, block_tables, out,
        scale * LOG2E, bsz * h_kv, n_m,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_cache.stride()[:4], block_tables.stride(0),
        H_KV=h_kv, G=group, G_PAD=g_pad, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        PAGE=page, PPB=ppb, BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PREC=dot_precision(q.dtype), UPCAST=upcast, QUANT=quant,
        num_warps=num_warps or (8 if block_m >= 128 else 4),
        num_stages=num_stages or tiles.num_stages,
    )
    return out
