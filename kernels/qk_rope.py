"""RoPE on the q and k heads of the fused qkv output, in place, in one kernel per layer;
optionally Qwen3's per-head RMSNorm before it and the paged KV write after it.

Unfused, the rotation is a table gather, casts, four products, two sums and a concat
(about a dozen launches per layer, twice that with qk-norm), then the KV write. Here one
program per token loads its q and k heads once, normalises them when ``q_weight`` is
given, rotates them (neox style: the two halves of each head, the fp32 cos/sin table of
``pdflow.model.rope``), writes them back into qkv and, given a cache, stores the rotated
k and the untouched v at the token's slot (layout of ``kernels.store_kv``; -1 skips).
Rounding follows ``kernels.reference_fused.qk_rope``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference_fused import qk_rope as qk_rope_reference

__all__ = ["qk_rope_", "qk_rope_reference"]


@triton.jit
def _norm_rotate(ptr, w_ptr, cos, sin, eps, H: tl.constexpr, HALF: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, QK_NORM: tl.constexpr):
    """Heads [0, H) of one token at ``ptr`` (D = 2 * HALF apart) rotated in place;
    returns the rotated halves (input dtype), their offsets and mask."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None] & (j < HALF)[None, :]
    offs = h[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = tl.rsqrt(ss / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        dt = ptr.dtype.element_ty
        x1 = ((x1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    o1 = (x1 * cos - x2 * sin).to(ptr.dtype.element_ty)
    o2 = (x2 * cos + x1 * sin).to(ptr.dtype.element_ty)
    tl.store(ptr + offs, o1, mask=mask)
    tl.store(ptr + offs + HALF, o2, mask=mask)
    return o1, o2, offs, mask


@triton.jit
def _qk_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_t, s_cs, eps, s_cb, s_cp, s_ch, s_ct,
    HQ: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    QK_NORM: tl.constexpr, WRITE_KV: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * s_cs + j, mask=j < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * s_cs + j, mask=j < HALF, other=0.0)[None, :]
    row = qkv_ptr + t * s_t
    _norm_rotate(row, qw_ptr, cos, sin, eps, HQ, HALF, BLOCK_HQ, BLOCK_HALF, QK_NORM)
    k_row = row + HQ * 2 * HALF
    k1, k2, offs, mask = _norm_rotate(k_row, kw_ptr, cos, sin, eps, HKV, HALF, BLOCK_HKV,
                                      BLOCK_HALF, QK_NORM)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        # Broadcast before comparing: the interpreter mis-types scalar-bool & block-bool.
        keep = mask & ((tl.zeros([BLOCK_HKV, BLOCK_HALF], tl.int64) + slot) >= 0)
        slot = tl.maximum(slot, 0)
        block = slot // (PAGE * PPB)
        off = slot % (PAGE * PPB)
        h = tl.arange(0, BLOCK_HKV)[:, None]
        dst = block * s_cb + (off // PAGE) * s_cp + (off % PAGE) * s_ct + h * s_ch + j[None, :]
        dt = kc_ptr.dtype.element_ty
        tl.store(kc_ptr + dst, k1.to(dt), mask=keep)
        tl.store(kc_ptr + dst + HALF, k2.to(dt), mask=keep)
        v_row = k_row + HKV * 2 * HALF
        v1 = tl.load(v_row + offs, mask=keep, other=0.0)
        v2 = tl.load(v_row + offs + HALF, mask=keep, other=0.0)
        tl.store(vc_ptr + dst, v1.to(dt), mask=keep)
        tl.store(vc_ptr + dst + HALF, v2.to(dt), mask=keep)


def qk_rope_(
    qkv: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor,
    sin_table: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
    eps: float = 1e-6, k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
):
    """Rotate (after qk-norm when the weights are given) the q and k heads of
    ``qkv [T, (H_q + 2 H_kv) * D]`` in place; with caches, also store k and v at
    ``slot_mapping``. Returns (q, k, v) as ``[T, H, D]`` views of qkv."""
    t, d = qkv.shape[0], head_dim
    half = d // 2
    assert d % 2 == 0 and qkv.shape[1] == (num_q_heads + 2 * num_kv_heads) * d
    assert qkv.stride(1) == 1 and positions.shape == (t,)
    assert cos_table.shape[1] == half and cos_table.stride() == sin_table.stride()
    assert cos_table.stride(1) == 1 and cos_table.dtype == torch.float32
    qk_norm = q_weight is not None
    if qk_norm:
        assert q_weight.shape == k_weight.shape == (d,)
        assert q_weight.dtype == k_weight.dtype == qkv.dtype
    write_kv = k_cache is not None
    if write_kv:
        _, ppb, h_kv, page, dc = k_cache.shape
        assert (h_kv, dc) == (num_kv_heads, d) and v_cache.shape == k_cache.shape
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
        assert slot_mapping.shape == (t,)
        cache_strides = k_cache.stride()[:4]
    else:
        ppb = page = 1
        cache_strides = (0, 0, 0, 0)
    if t:
        block_half = triton.next_power_of_2(half)
        block_hq = triton.next_power_of_2(num_q_heads)
        _qk_rope_kernel[(t,)](
            qkv, positions, cos_table, sin_table,
            q_weight if qk_norm else cos_table, k_weight if qk_norm else cos_table,
            k_cache if write_kv else qkv, v_cache if write_kv else qkv,
            slot_mapping if write_kv else positions,
            qkv.stride(0), cos_table.stride(0), eps, *cache_strides,
            HQ=num_q_heads, HKV=num_kv_heads, HALF=half, BLOCK_HQ=block_hq,
            BLOCK_HKV=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=block_half,
            QK_NORM=qk_norm, WRITE_KV=write_kv, PAGE=page, PPB=ppb,
            num_warps=4 if block_hq * block_half >= 1024 else 1,
        )
    q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    return q.view(t, num_q_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d)
