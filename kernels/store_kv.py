"""KV write: scatter new tokens' K/V into the paged, head-major cache.

A 16/32-bit cache: one program per token writes every KV head of both fields; the token
axis is grid axis 0, so any batch size launches (CUDA caps y/z at 65535). ``page_tokens`` and
``pages_per_block`` are compile-time constants, so the page-16 and page-128 bindings
each get their own specialised binary with the slot arithmetic folded to shifts.

An fp8 cache (with its scale caches) is quantized here as kernels/kv_quant.py does: each
(token, head)'s exponent from the bits of its amax, the values times an exact power of
two, rounded to e4m3 (a row with a NaN or inf as zeros under exponent 255, as there); the
scale caches share the cache's layout with D = 1, so a token-head's scale sits at its first
element's offset divided by D. An fp8 V goes into its head page transposed (``[D, page]``,
kernels/reference.py): element ``d`` of token ``t`` at ``d * PAGE + t``, so the fp8 write
takes a program per (16 tokens, KV head) and stores V as a [D, tokens] tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import kv_scales, v_column
from .kv_quant import HEADROOM_BITS, MIN_NORMAL, NONFINITE_EXP
from .reference import store_kv as store_kv_reference

_MIN_NORMAL = tl.constexpr(MIN_NORMAL)  # a jit function reads only constexpr globals
_NONFINITE_EXP = tl.constexpr(NONFINITE_EXP)

__all__ = ["store_kv", "store_kv_reference"]


@triton.jit
def _round_e4m3(y):
    """fp32 ``y`` (|y| < 256) rounded to e4m3 as kv_quant.quantize does, still fp32, so
    the cast after it is exact: 3 mantissa bits, ties to even, by integer rounding of the
    bits (a carry may step the exponent); below e4m3's smallest normal (2^-6) zero. The
    interpreter's own fp8 cast loses such a carry for negative values (-127.7 became -64)
    and truncates subnormals, so nothing here leaves rounding to the cast."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    return tl.where(tl.abs(y) < _MIN_NORMAL, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _quantized(x, HEADROOM: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] (fp32, padding 0) -> (values / 2^s per row rounded to e4m3,
    biased exponent); a row with a NaN or inf (exponent bits all ones; tested on the bits,
    as a max may drop a NaN) -> zeros, exponent 255."""
    bad = tl.max((((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) == 0xFF).to(tl.int32), axis=1) > 0
    amax = tl.max(tl.abs(x), axis=1)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - HEADROOM
    e = tl.minimum(tl.maximum(e, 1), 253)
    inv = ((254 - e) << 23).to(tl.float32, bitcast=True)
    y = tl.where(bad[:, None], 0.0, _round_e4m3(x * inv[:, None]))
    return y, tl.where(bad, _NONFINITE_EXP, e)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_cp, s_ch, s_ct,
    H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    # Broadcast before comparing: the interpreter mis-types scalar-bool & block-bool.
    keep = (tl.zeros([BLOCK_H, BLOCK_D], tl.int64) + slot) >= 0
    slot = tl.maximum(slot, 0)
    block = slot // (PAGE * PPB)
    off = slot % (PAGE * PPB)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < H)[:, None] & (d < D)[None, :] & keep
    dst = block * s_cb + (off // PAGE) * s_cp + (off % PAGE) * s_ct + h[:, None] * s_ch + d[None, :]
    k = tl.load(k_ptr + i * s_kn + h[:, None] * s_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + i * s_vn + h[:, None] * s_vh + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_kv_fp8_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, n,
    s_kn, s_kh, s_vn, s_vh,
    s_cb, s_cp, s_ch, s_ct,
    D: tl.constexpr, PAGE: tl.constexpr, PPB: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HEADROOM: tl.constexpr,
):
    """The quantizing write, one program per (``BLOCK_T`` tokens, KV head). V is stored
    [D, PAGE] per head page: a run of consecutive slots inside one page goes through
    addresses contiguous along the tokens, so the compiler puts neighbouring lanes on
    neighbouring tokens; other slots go token by token. (A program per token and every
    head wrote a token's D bytes a page apart at 0.13-0.16x the bf16 write's speed at page
    128 on the H200; this kernel writes at 0.59-0.70x.)"""
    h = tl.program_id(1)
    i = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + i, mask=i < n, other=-1).to(tl.int64)
    row_ok = slot >= 0
    slot = tl.maximum(slot, 0)
    off = slot % (PAGE * PPB)
    tok = off % PAGE
    head = (slot // (PAGE * PPB)) * s_cb + (off // PAGE) * s_cp + h * s_ch + tok * s_ct
    d = tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + (i * s_kn + h * s_kh)[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_ptr + (i * s_vn + h * s_vh)[:, None] + d[None, :], mask=mask, other=0.0)
    k, ke = _quantized(k.to(tl.float32), HEADROOM)
    v, ve = _quantized(v.to(tl.float32), HEADROOM)
    tl.store(ks_ptr + head // D, ke.to(tl.uint8), mask=row_ok)
    tl.store(vs_ptr + head // D, ve.to(tl.uint8), mask=row_ok)
    tl.store(kc_ptr + head[:, None] + d[None, :], k.to(kc_ptr.dtype.element_ty), mask=mask)
    v = tl.trans(v).to(vc_ptr.dtype.element_ty)  # [BLOCK_D, BLOCK_T]
    v_col = v_column(head, tok, s_ct)  # each token's column in its [D, PAGE] head page
    # A run (every token valid, consecutive slots inside one page, as a prefill chunk's
    # mostly are): addresses the compiler can see are contiguous along the tokens, so it
    # lays the lanes along them; otherwise each token's column on its own.
    t = tl.arange(0, BLOCK_T)
    first = tl.sum(tl.where(t == 0, slot, 0))
    run = (tl.sum(((slot == first + t) & row_ok).to(tl.int32)) == BLOCK_T) & (first % PAGE + BLOCK_T <= PAGE)
    if run:
        col0 = tl.sum(tl.where(t == 0, v_col, 0))
        tl.store(vc_ptr + col0 + d[:, None] * PAGE + t[None, :], v, mask=(d < D)[:, None])
    else:
        tl.store(vc_ptr + d[:, None] * PAGE + v_col[None, :], v, mask=tl.trans(mask))


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
             num_warps: int | None = None, fp8_tokens: int | None = None) -> None:
    """Write token ``i``'s K/V ([N, H_kv, D]) to slot ``slot_mapping[i]`` (-1 skips);
    quantized per (token, head) into an fp8 cache when its scale caches are given (V
    into transposed head pages)."""
    n, h, d = k.shape
    _, ppb, hc, page, dc = k_cache.shape
    assert (h, d) == (hc, dc) and v.shape == k.shape and v_cache.shape == k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    quant, k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale, slot_mapping)
    if n == 0:
        return
    block_h, block_d = triton.next_power_of_2(h), triton.next_power_of_2(d)
    if quant:  # tokens a program: 16 beat 1, 32 and 64 on the H200 (bench/KERNEL_NOTES.md)
        block_t = fp8_tokens or min(16, page)  # a run never spans pages
        _store_kv_fp8_kernel[(triton.cdiv(n, block_t), h)](
            k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale, n,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *k_cache.stride()[:4],
            D=d, PAGE=page, PPB=ppb, BLOCK_T=block_t, BLOCK_D=block_d,
            HEADROOM=HEADROOM_BITS, num_warps=num_warps or 4,
        )
        return
    if num_warps is None:
        num_warps = 4 if block_h * block_d >= 1024 else 1
    _store_kv_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:4],
        H=h, D=d, PAGE=page, PPB=ppb, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=num_warps,
    )
